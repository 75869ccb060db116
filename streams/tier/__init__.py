"""Tiered storage: sealed fragments in an S3-compatible object store (objstore: the client; seaweed: the
embedded server; segment: the object format; reader: the read path)."""
