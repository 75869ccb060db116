"""The bookie: Scroll's storage server (journal, entry logs, RocksDB index, caches, term rules)."""
