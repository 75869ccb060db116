"""Tests of the object-store tier (issue 24)."""
