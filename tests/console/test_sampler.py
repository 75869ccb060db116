"""The console's sampler against a real /metrics endpoint (prometheus_client's exposition, as
``scroll standalone`` serves it, with its ``name[]`` filter): what it asks for and how often.
Nothing here needs the cluster: each test takes well under a second."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
import urllib.parse

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from compat_kafka.console.timeseries import JOBS, Sampler
from streams.tools.localcluster import free_port


class Standalone:
    """A /metrics endpoint holding what standalone's holds (job counters, one ``scroll_stream_bytes``
    series per stream) that records every request's query."""

    def __init__(self, streams: int = 200):
        self.registry = CollectorRegistry()
        Counter("scroll_retention_runs", "runs", ["outcome"], registry=self.registry).labels("ok").inc(3)
        g = Gauge("scroll_stream_bytes", "bytes", ["stream"], registry=self.registry)
        for i in range(streams):
            g.labels(f"t-{i}").set(1000 + i)
        self.queries: list[dict] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                outer.queries.append(query)
                reg = outer.registry.restricted_registry(query["name[]"]) if "name[]" in query else outer.registry
                body = generate_latest(reg)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *_exc):
        self.server.shutdown()
        self.server.server_close()


def test_sampler_never_asks_standalone_for_the_per_stream_series():
    """The idle cost of the console and of standalone must not grow with the streams: every scrape
    of standalone asks for the job counters alone (the old sampler read the whole page, 2,000
    ``scroll_stream_bytes`` series with 2,000 partitions, every sixth sample)."""
    with Standalone() as sa:
        s = Sampler({"standalone": sa.url}, interval_s=10.0)

        async def sample(n):
            for _ in range(n):
                await s.sample_once()

        asyncio.run(sample(8))
    assert len(sa.queries) == 8
    for q in sa.queries:
        assert sorted(q.get("name[]", [])) == sorted(JOBS.values()), q
    assert not s.ring.names("stream_bytes:")
    assert s.jobs["retention"]["ok"] == 3.0  # the job counters still read
    assert not any(m.startswith("scroll_stream_bytes") for m, _labels, _v in s.last["standalone"])


def test_sampler_samples_slowly_while_nobody_looks_and_wakes_on_a_page():
    """No page asked for: one sample every ``idle_interval_s``; a page request samples at once and
    then every ``interval_s``. Only the streams whose page was shown have their bytes sampled."""
    asked: list[list[str]] = []

    async def stream_bytes(names):
        asked.append(sorted(names))
        return {n: 42 for n in names}

    async def scenario():
        with Standalone(streams=3) as sa:
            s = Sampler({"standalone": sa.url}, interval_s=0.05, idle_interval_s=3600.0, idle_after_s=3600.0,
                        stream_bytes=stream_bytes)
            assert s.next_interval() == 3600.0  # nobody has looked yet
            stop = asyncio.Event()
            task = asyncio.create_task(s.run(stop))
            try:
                await _until(lambda: s.samples_taken >= 1)
                assert asked == []  # no stream page shown: no stream read
                s.watch("orders-0")
                s.touch()  # a page view wakes it long before the idle hour is up
                await _until(lambda: s.samples_taken >= 3)
                assert s.next_interval() == 0.05
                assert asked[-1] == ["orders-0"]
                _times, values = s.ring.get("stream_bytes:orders-0")
                assert values[0] is None and values[-1] == 42  # no point made up before it was watched
            finally:
                stop.set()
                await asyncio.wait_for(task, 10)

    asyncio.run(scenario())


async def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail("timed out")
        await asyncio.sleep(0.01)
