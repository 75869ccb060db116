"""Prometheus metrics of one bookie.

How this works: ``BookieMetrics`` owns its own ``CollectorRegistry`` (so several bookies can live in
one test process) and the metric objects. The hot paths update them once per batch or per journal
group, never per add: a prometheus counter takes a lock. Rates (adds/s, bytes/s) and hit ratios are
derived in Prometheus from the counters (``rate(scroll_bookie_adds_total[1m])``); the cache hit
ratio is also exported directly as a gauge computed at scrape time. ``serve(port)`` starts the HTTP
endpoint on 127.0.0.1 (``fragments.metrics_http``: its thread sleeps until a scrape comes).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fragments.metrics_http import serve_metrics

_FSYNC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_GROUP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_GROUP_BYTES_BUCKETS = (4096, 16384, 65536, 262144, 1048576, 4194304, 16777216)


class BookieMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.adds = Counter("scroll_bookie_adds", "Adds accepted (rate = adds/s)", registry=r)
        self.add_bytes = Counter("scroll_bookie_add_bytes", "Payload bytes accepted (rate = bytes/s)", registry=r)
        self.add_rejects = Counter("scroll_bookie_add_rejects", "Adds answered with a non-OK status", ["status"], registry=r)
        self.fsync_seconds = Histogram(
            "scroll_bookie_journal_fsync_seconds", "Journal write+fdatasync latency per group", buckets=_FSYNC_BUCKETS, registry=r
        )
        self.group_records = Histogram(
            "scroll_bookie_journal_group_records", "Journal records per group commit", buckets=_GROUP_BUCKETS, registry=r
        )
        self.group_bytes = Histogram(
            "scroll_bookie_journal_group_bytes", "Bytes per group commit", buckets=_GROUP_BYTES_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("scroll_bookie_add_queue_depth", "Add batches waiting for their journal sync", registry=r)
        self.write_cache_bytes = Gauge("scroll_bookie_write_cache_bytes", "Unflushed bytes in the write cache", registry=r)
        self.write_cache_retired_bytes = Gauge(
            "scroll_bookie_write_cache_retired_bytes",
            "Bytes of flushed write-cache generations kept for disk reads that began before their flush", registry=r,
        )
        self.cache_lookups = Counter(
            "scroll_bookie_cache_lookups", "Read lookups by cache and result", ["cache", "result"], registry=r
        )
        self.cache_hit_ratio = Gauge("scroll_bookie_cache_hit_ratio", "Hits / lookups since start", ["cache"], registry=r)
        self.flushes = Counter("scroll_bookie_flushes", "Write-cache flushes (checkpoints)", registry=r)
        self.flush_seconds = Histogram("scroll_bookie_flush_seconds", "Flush duration", registry=r)
        self.gc_reclaimed_bytes = Counter("scroll_bookie_gc_reclaimed_bytes", "Bytes freed by GC and compaction", registry=r)
        self.journal_reclaimed_bytes = Counter(
            "scroll_bookie_journal_reclaimed_bytes", "Journal bytes freed after checkpoints", registry=r
        )
        self.read_only = Gauge("scroll_bookie_read_only", "1 when the bookie refuses writes", registry=r)
        self.scrub_entries = Counter("scroll_bookie_scrub_entries", "Stored entries read back and verified by the scrubber", registry=r)
        self.scrub_bytes = Counter("scroll_bookie_scrub_bytes", "Entry-log bytes read back by the scrubber", registry=r)
        self.scrub_corrupt = Counter(
            "scroll_bookie_scrub_corrupt_entries",
            "Corrupt stored copies found and removed from the index, by who found them", ["found_by"], registry=r,
        )
        self.scrub_passes = Counter("scroll_bookie_scrub_passes", "Completed scrub passes", registry=r)
        self.scrub_last_pass = Gauge(
            "scroll_bookie_scrub_last_pass_timestamp_seconds", "Unix time the last complete scrub pass ended", registry=r
        )
        self.scrub_pass_seconds = Gauge("scroll_bookie_scrub_last_pass_seconds", "Duration of the last scrub pass", registry=r)
        self.reads = Counter("scroll_bookie_read_entries", "Entries returned by reads", registry=r)
        self._hits = {"write": [0, 0], "read": [0, 0]}
        for cache in self._hits:
            self.cache_hit_ratio.labels(cache).set_function(self._ratio_fn(cache))

    def _ratio_fn(self, cache: str):
        def ratio() -> float:
            hits, total = self._hits[cache]
            return hits / total if total else 0.0

        return ratio

    def cache_lookup(self, cache: str, hits: int, misses: int) -> None:
        if hits:
            self.cache_lookups.labels(cache, "hit").inc(hits)
        if misses:
            self.cache_lookups.labels(cache, "miss").inc(misses)
        counts = self._hits[cache]
        counts[0] += hits
        counts[1] += hits + misses

    def journal_group(self, seconds: float, nbytes: int, nrecords: int) -> None:
        self.fsync_seconds.observe(seconds)
        self.group_bytes.observe(nbytes)
        self.group_records.observe(nrecords)

    def serve(self, port: int, host: str = "127.0.0.1") -> object:
        return serve_metrics(port, host, self.registry)
