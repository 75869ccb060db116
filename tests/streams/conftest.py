from __future__ import annotations

import pytest

from streams.tools.localcluster import LocalCluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Real etcd + 4 real bookie processes on loopback, shared by the stream tests."""
    c = LocalCluster(tmp_path_factory.mktemp("cluster"), bookies=4)
    c.start()
    yield c
    c.stop()


@pytest.fixture()
def client(cluster):
    from streams.sync import connect

    c = connect(cluster.metadata_url, add_timeout_s=5.0, call_timeout_s=5.0)
    yield c
    c.close()


_n = [0]


@pytest.fixture()
def stream_name(request):
    _n[0] += 1
    return f"{request.node.name[:40].replace('[', '-').replace(']', '')}-{_n[0]}"
