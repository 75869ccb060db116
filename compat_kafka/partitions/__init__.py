"""A partition = a stream: its log (reads, writes, high watermark, producer state) and
incremental fetch sessions (KIP-227)."""
