"""Prometheus metrics of one Kafka listener: the consumer groups it coordinates and their lag.

How this works. ``ListenerMetrics`` owns its own ``CollectorRegistry`` (several listeners can live
in one test process), like ``bookie/metrics.py``, and serves it over HTTP on loopback by default
(``scroll kafka --metrics-port``). Group lag is computed at scrape time, in the HTTP server's
thread, by ``group_admin.KafkaAdmin`` over the Kafka protocol against this listener: ListGroups of
this listener gives exactly the groups it coordinates (so several listeners never report a group
twice), and each group's describe gives committed offsets, log-end offsets (asked of each
partition's leader, wherever it runs) and members. A scrape therefore costs a few requests per
group; ``max_groups`` bounds it. A failure is counted (``scroll_kafka_group_scrape_errors``)
and the groups it hid are left out of that scrape rather than failing the endpoint.
"""

from __future__ import annotations

import logging

from kio.schema.list_groups.v5 import ListGroupsRequest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from fragments import aioloop
from fragments.metrics_http import serve_metrics

from ..groups.group_admin import AdminError, GroupView, KafkaAdmin
from ..security.client_security import KafkaClientConfig

log = logging.getLogger(__name__)


class GroupLagCollector:
    def __init__(self, bootstrap: str, errors: Counter, max_groups: int = 500, timeout_s: float = 10.0):
        self.bootstrap = bootstrap
        self.security: KafkaClientConfig | None = None  # how to reach the listener (set once it serves)
        self.errors = errors
        self.max_groups = max_groups
        self.timeout_s = timeout_s

    def describe(self):
        return []  # no samples at registration time (the listener may not be serving yet)

    def collect(self):
        views = aioloop.run(self._views())
        lag = GaugeMetricFamily("scroll_kafka_group_lag", "Log-end offset minus committed offset, per partition",
                                labels=["group", "topic", "partition"])
        committed = GaugeMetricFamily("scroll_kafka_group_committed_offset", "Committed offset, per partition",
                                      labels=["group", "topic", "partition"])
        log_end = GaugeMetricFamily("scroll_kafka_group_log_end_offset", "Log-end offset of the group's partitions",
                                    labels=["group", "topic", "partition"])
        total = GaugeMetricFamily("scroll_kafka_group_lag_sum", "Lag summed over the group's partitions",
                                  labels=["group"])
        members = GaugeMetricFamily("scroll_kafka_group_members", "Active members of the group",
                                    labels=["group", "type", "state"])
        for v in views:
            members.add_metric([v.group, v.group_type, v.state], len(v.members))
            total.add_metric([v.group], v.lag)
            for r in v.partitions:
                labels = [v.group, r.topic, str(r.partition)]
                if r.log_end is not None:
                    log_end.add_metric(labels, r.log_end)
                if r.committed is not None:
                    committed.add_metric(labels, r.committed)
                if r.lag is not None:
                    lag.add_metric(labels, r.lag)
        return [lag, committed, log_end, total, members]

    async def _views(self) -> list[GroupView]:
        out = []
        async with KafkaAdmin(self.bootstrap, timeout_s=self.timeout_s, client_id="scroll-metrics",
                              security=self.security) as admin:
            try:  # this listener's ListGroups: the groups it coordinates
                r = await admin.any_call(ListGroupsRequest(states_filter=(), types_filter=()))
                groups = sorted(g.group_id for g in r.groups)[:self.max_groups]
            except AdminError as exc:
                self.errors.inc()
                log.warning("metrics: listing groups failed: %s", exc)
                return []
            for g in groups:
                try:
                    out.append(await admin.describe(g))
                except AdminError as exc:
                    if "does not exist" not in str(exc):
                        self.errors.inc()
                        log.warning("metrics: group %s: %s", g, exc)
        return out


class OverloadCollector:
    """Connection limits, quota throttling and produce backpressure of the listener (``KafkaServer.stats``,
    read at scrape time: plain ints, no lock needed)."""

    def __init__(self):
        self.server = None

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        if self.server is None:
            return []
        st = self.server.stats
        refused = CounterMetricFamily("scroll_kafka_connections_refused", "Connections closed at once over a limit",
                                      labels=["reason"])
        refused.add_metric(["max_connections"], st["refused_max_connections"])
        refused.add_metric(["max_connections_per_ip"], st["refused_max_connections_per_ip"])
        throttled = CounterMetricFamily("scroll_kafka_throttled_responses", "Answers over a client quota (muted)")
        throttled.add_metric([], st["throttled_responses"])
        waits = CounterMetricFamily("scroll_kafka_produce_bytes_waits",
                                    "Produce requests that waited for room in --max-inflight-produce-bytes")
        waits.add_metric([], st["produce_bytes_waits"])
        inflight = GaugeMetricFamily("scroll_kafka_inflight_produce_bytes",
                                     "Memory counted for produce requests read, not answered (4x their bytes)")
        inflight.add_metric([], self.server.produce_budget.used)
        return [refused, throttled, waits, inflight]


class ListenerMetrics:
    def __init__(self, bootstrap: str, max_groups: int = 500):
        r = self.registry = CollectorRegistry()
        self.scrape_errors = Counter("scroll_kafka_group_scrape_errors", "Group lag scrapes that failed", registry=r)
        self.collector = GroupLagCollector(bootstrap, self.scrape_errors, max_groups)
        r.register(self.collector)
        self.overload = OverloadCollector()
        r.register(self.overload)
        self._server = None

    def use(self, bootstrap: str, security: KafkaClientConfig | None) -> None:
        """Scrape through this listener address with these client settings (a secured listener)."""
        self.collector.bootstrap = bootstrap
        self.collector.security = security

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        self._server = serve_metrics(port, host, self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
