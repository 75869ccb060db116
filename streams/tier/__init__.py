"""Tiered storage: sealed fragments offloaded to an S3-compatible object store (issue 24)."""
