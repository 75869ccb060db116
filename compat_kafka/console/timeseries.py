"""The console's own time series: a bounded ring of samples scraped from the processes' /metrics.

How this works. ``Sampler.run`` scrapes every source (``name=URL``: ``standalone``, ``kafka`` or a
bookie id) every ``interval_s`` (10 s) and appends one sample to ``Ring``: a timestamp and, per
series, one float. A series is a counter summed over the sources (bookie bytes written, entries
read, errors) or a gauge (a group's lag, a stream's bytes). The ring keeps ``size`` samples (360: one
hour) and at most ``max_series`` series (the rest are not recorded, and ``dropped_series`` says how
many), so its memory is bounded whatever the cluster holds. Rates are computed when a graph is
drawn (``rate``); a counter that went down (a process restarted) counts from zero again.
The sampler also notes when the jobs' run counters of standalone last moved (``jobs``).

Cost: nothing grows with the streams. standalone's /metrics has one ``scroll_stream_bytes`` series
per stream (2,000 with 2,000 partitions): rendering and parsing that page was most of an idle
console's CPU and half of an idle standalone's. So standalone is only ever asked for the job
counters (prometheus_client's ``?name[]=`` filter: the per-stream gauge is not even collected).
A stream's bytes (the stream page's graph) are read where they are kept, the stream's fragment
records in the metadata store (``stream_bytes``, the same sum as the gauge's), for the streams whose
page was shown in the last ``watch_s`` (an hour: the ring's span) only, at most ``MAX_WATCHED``:
the graph starts at the first sample after the page was first opened.
While no page was asked for in ``idle_after_s`` (10 min), the sampler samples every
``idle_interval_s`` (60 s) instead of ``interval_s``; the next page request wakes it at once (a
sample right away, then every ``interval_s``). The graphs only ever hold real samples: an idle
stretch shows as points 60 s apart.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

# series name -> (metric sample name, how it is combined)
COUNTERS = {
    "bookie_add_bytes": ("scroll_bookie_add_bytes_total",),
    "bookie_adds": ("scroll_bookie_adds_total",),
    "bookie_reads": ("scroll_bookie_read_entries_total",),
    "errors": ("scroll_bookie_add_rejects_total", "scroll_kafka_connections_refused_total",
               "scroll_kafka_group_scrape_errors_total"),
}
JOBS = {"retention": "scroll_retention_runs_total", "compaction": "scroll_compaction_runs_total",
        "offload": "scroll_tier_runs_total"}


class Ring:
    def __init__(self, size: int = 360, max_series: int = 1000):
        self.size = size
        self.max_series = max_series
        self.times: collections.deque[float] = collections.deque(maxlen=size)
        self.series: dict[str, collections.deque[float]] = {}
        self.dropped_series = 0

    def add(self, t: float, values: dict[str, float]) -> None:
        self.times.append(t)
        n = len(self.times)
        dropped = 0
        for name, v in values.items():
            d = self.series.get(name)
            if d is None:
                if len(self.series) >= self.max_series:
                    dropped += 1
                    continue
                d = self.series[name] = collections.deque([math.nan] * (n - 1), maxlen=self.size)
            d.append(v)
        for d in self.series.values():
            if len(d) < n:  # no value this time
                d.append(math.nan)
        self.dropped_series = dropped

    def get(self, name: str) -> tuple[list[float], list[float | None]]:
        d = self.series.get(name)
        if d is None:
            return list(self.times), [None] * len(self.times)
        return list(self.times), [None if math.isnan(v) else v for v in d]

    def rate(self, name: str) -> tuple[list[float], list[float | None]]:
        """Per-second increase of a counter (None where unknown)."""
        times, values = self.get(name)
        out: list[float | None] = [None]
        for i in range(1, len(values)):
            a, b, dt = values[i - 1], values[i], times[i] - times[i - 1]
            if a is None or b is None or dt <= 0:
                out.append(None)
            else:
                out.append((b - a if b >= a else b) / dt)
        return times, out[:len(values)]

    def names(self, prefix: str) -> list[str]:
        return sorted(n for n in self.series if n.startswith(prefix))


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.append((s.name, s.labels, s.value))
    return out


def _fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - operator-given http URLs
        return r.read(8 << 20).decode("utf-8", "replace")


MAX_WATCHED = 64  # streams whose bytes are sampled (the most recently shown pages)


class Sampler:
    def __init__(self, sources: dict[str, str], ring: Ring | None = None, interval_s: float = 10.0, *,
                 idle_interval_s: float = 60.0, idle_after_s: float = 600.0, watch_s: float = 3600.0,
                 stream_bytes: Callable[[list[str]], Awaitable[dict[str, int]]] | None = None):
        self.sources = dict(sources)
        self.ring = ring or Ring()
        self.interval_s = interval_s
        self.idle_interval_s = max(interval_s, idle_interval_s)
        self.idle_after_s = idle_after_s
        self.watch_s = watch_s
        self.stream_bytes = stream_bytes  # names -> bytes of their fragments (from the metadata store)
        self.watched: dict[str, float] = {}  # stream -> when its page (or graph) was last asked for
        self.last_view = -math.inf  # monotonic time of the last page request
        self._wake = asyncio.Event()
        self.up: dict[str, bool] = {}  # source -> answered the last scrape
        self.last: dict[str, list] = {}  # source -> its last samples (the bookies page reads them)
        self.jobs: dict[str, dict] = {}  # job -> {"ok": n, "failed": n, "last_run": t, "last_outcome": ...}
        self.samples_taken = 0

    def touch(self) -> None:
        """A page was asked for: sample every ``interval_s`` again (and now, if it was idle)."""
        idle = self.idle
        self.last_view = time.monotonic()
        if idle:
            self._wake.set()

    def watch(self, stream: str) -> None:
        """Sample this stream's bytes from now on (for ``watch_s`` after it was last asked for)."""
        self.watched.pop(stream, None)
        self.watched[stream] = time.monotonic()
        while len(self.watched) > MAX_WATCHED:
            del self.watched[next(iter(self.watched))]

    @property
    def idle(self) -> bool:
        return time.monotonic() - self.last_view >= self.idle_after_s

    def next_interval(self) -> float:
        return self.idle_interval_s if self.idle else self.interval_s

    async def sample_once(self) -> None:
        now = time.time()
        results = await asyncio.gather(*(asyncio.to_thread(_fetch, self._url(name, url), 2.0)
                                         for name, url in self.sources.items()), return_exceptions=True)
        values: dict[str, float] = {k: 0.0 for k in COUNTERS}
        for (name, _url), res in zip(self.sources.items(), results):
            if isinstance(res, BaseException):
                self.up[name] = False
                self.last.pop(name, None)
                continue
            self.up[name] = True
            try:
                samples = parse_metrics(res)
            except Exception as exc:  # noqa: BLE001 - one bad endpoint does not stop the others
                log.warning("console: cannot parse the metrics of %s: %s", name, exc)
                continue
            self.last[name] = samples
            self._collect(name, samples, values, now)
        await self._stream_values(values)
        self.ring.add(now, values)
        self.samples_taken += 1

    async def _stream_values(self, values: dict[str, float]) -> None:
        cutoff = time.monotonic() - self.watch_s
        for name in [n for n, t in self.watched.items() if t < cutoff]:
            del self.watched[name]
        if not self.watched or self.stream_bytes is None:
            return
        try:
            got = await self.stream_bytes(list(self.watched))
        except Exception as exc:  # noqa: BLE001 - the other graphs still get their sample
            log.warning("console: cannot read the streams' bytes: %s", exc)
            return
        for name, v in got.items():
            values[f"stream_bytes:{name}"] = float(v)

    @staticmethod
    def _url(name: str, url: str) -> str:
        if name != "standalone":
            return url
        query = urllib.parse.urlencode([("name[]", m) for m in JOBS.values()])
        return url + ("&" if "?" in url else "?") + query

    def _collect(self, source: str, samples: list, values: dict[str, float], now: float) -> None:
        for metric, labels, v in samples:
            for series, names in COUNTERS.items():
                if metric in names:
                    values[series] += v
            if metric == "scroll_kafka_group_lag_sum" and "group" in labels:
                values[f"lag:{labels['group']}"] = v
            elif metric == "scroll_bookie_write_cache_bytes":
                values[f"bookie_cache:{source}"] = v
        for job, metric in JOBS.items():
            runs = {labels.get("outcome"): v for m, labels, v in samples if m == metric}
            if not runs:
                continue
            j = self.jobs.setdefault(job, {"ok": 0.0, "failed": 0.0, "last_run": None, "last_outcome": None})
            for outcome in ("ok", "failed"):
                n = runs.get(outcome, 0.0)
                if n > j[outcome] and self.samples_taken:
                    j["last_run"], j["last_outcome"] = now, outcome
                j[outcome] = n

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        while not stop.is_set():
            self._wake.clear()
            try:
                await self.sample_once()
            except Exception as exc:  # noqa: BLE001 - the console keeps serving without graphs
                log.warning("console: sampling failed: %s", exc)
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
            try:
                await asyncio.wait(waits, timeout=self.next_interval(), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
