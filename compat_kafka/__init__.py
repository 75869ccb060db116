"""Kafka broker protocol shim (not built yet: see issue 5)."""
