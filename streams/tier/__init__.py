"""Tiered storage: sealed fragments in an S3-compatible object store."""
