"""End to end with etcd's auth on: bookies register and clients produce and read through a
metadata URL that carries root's password (``etcd://root:<password>@host:port``)."""

from __future__ import annotations

import pytest

from fragments.store import MetadataAuthError
from streams.sync import connect
from streams.tools.localcluster import LocalCluster

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
        with pytest.raises(Exception) as info:  # no credentials: the clear error, not a hang
            connect(f"etcd://127.0.0.1:{cluster.etcd_port}", add_timeout_s=5.0, call_timeout_s=5.0)
        chain = [info.value, info.value.__cause__, info.value.__context__]
        assert any(isinstance(e, MetadataAuthError) for e in chain) or "requires authentication" in str(info.value)
