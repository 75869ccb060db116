"""End to end with etcd's auth on: bookies register and clients produce and read through a
metadata URL that carries root's password (``etcd://root:<password>@host:port``)."""

from __future__ import annotations

import pytest

from fragments.store import MetadataAuthError
from streams.sync import connect
from streams.tools.localcluster import LocalCluster
from tests.ports import port_block

pytestmark = pytest.mark.process

PASSWORD = "e2e:p@ss/w%rd"


def test_produce_and_read_with_etcd_auth(tmp_path):
    with LocalCluster(tmp_path, bookies=3, etcd_password=PASSWORD, etcd_auth_token_ttl=2) as cluster:
        assert cluster.metadata_url.startswith("etcd://root:")
        for b in cluster.bookies:  # the bookies registered through the credentials, and say so without them
            assert "registered" in b.output() and "root:***@" in b.output() and "p%40ss" not in b.output()
        with connect(cluster.metadata_url, add_timeout_s=5.0, call_timeout_s=5.0) as client:
            client.create_stream("secured", ensemble=3, write_quorum=3, ack_quorum=2)
            with client.producer("secured") as p:
                assert p.append_many([b"v%d" % i for i in range(100)]) == list(range(100))
            c = client.consumer("secured", start="earliest")
            got = []
            while batch := c.read(1000):
                got.extend(batch)
            assert [r.value for r in got] == [b"v%d" % i for i in range(100)]
        with pytest.raises(MetadataAuthError, match="requires authentication"):  # the clear error, not a hang
            connect(f"etcd://127.0.0.1:{cluster.etcd_port}", add_timeout_s=5.0, call_timeout_s=5.0)


def test_standalone_with_etcd_auth(tmp_path):
    import stat

    from streams.tools.standalone import Standalone, StandaloneConfig, etcd_password_file

    base = port_block(10)
    config = StandaloneConfig(data_dir=tmp_path, etcd_port=base, etcd_peer_port=base + 1, kafka_port=base + 2,
                              bookie_base_port=base + 3, metrics_port=base + 5, bookies=2, etcd_auth=True,
                              object_store=False, console_port=base + 9)
    sa = Standalone(config)
    try:
        sa.start(60)
        pw_file = etcd_password_file(tmp_path.resolve())
        password = pw_file.read_text().strip()
        assert stat.S_IMODE(pw_file.stat().st_mode) == 0o600
        banner = sa.banner()
        assert "root:***@" in banner and str(pw_file) in banner and password not in banner
        assert sa.kafka.alive  # the Kafka listener reached etcd with the credentials
        with connect(sa.cluster.metadata_url, add_timeout_s=5.0, call_timeout_s=5.0) as client:
            client.create_stream("s", ensemble=2, write_quorum=2, ack_quorum=2)
            with client.producer("s") as p:
                assert p.append(b"x") == 0
        with pytest.raises(MetadataAuthError):
            connect(f"etcd://127.0.0.1:{base}", add_timeout_s=5.0, call_timeout_s=5.0)
    finally:
        sa.stop()
    assert password not in (tmp_path / "kafka" / "kafka.log").read_text(errors="replace")
