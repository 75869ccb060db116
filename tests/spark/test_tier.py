"""Spark batch reads of streams whose front fragments are offloaded to the object store (tiered
storage, issue 24): the rows equal a native read, the executors read the released fragments from
their objects, and a lost object fails the query with the error naming it, whatever failOnDataLoss
says (the records exist; they cannot be read)."""

from __future__ import annotations

import asyncio
import json

import pytest

from fragments.tier import TIER_CONFIG_KEY
from streams.client import connect
from streams.tier.objstore import ObjectStore
from streams.tools.localcluster import free_port
from tests.tier.test_read import _make, _offload, _read_all

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def tier_config(spark_cluster, tmp_path_factory):
    from streams.tier.seaweed import SeaweedS3

    s3 = SeaweedS3(tmp_path_factory.mktemp("spark-s3"), s3_port=free_port(), master_port=free_port(),
                   volume_port=free_port(), filer_port=free_port())
    s3.start()
    config = s3.tier_config(prefix="sparktier", request_timeout_s=5.0, retries=1, retry_timeout_s=2.0)

    async def setup(value):
        c = await connect(spark_cluster.metadata_url)
        try:
            if value is None:
                await c.cluster.store.delete(TIER_CONFIG_KEY)
            else:
                await c.cluster.store.put(TIER_CONFIG_KEY, value)
        finally:
            await c.close()

    asyncio.run(setup(json.dumps(config.to_dict()).encode()))
    try:
        yield config
    finally:
        asyncio.run(setup(None))
        s3.stop()


def _df(spark, url, stream, **opts):
    r = spark.read.format("scroll").option("metadata", url).option("streams", stream).option("includeHeaders", "true")
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def _rows(df):
    return sorted((r.offset, r.key, r.value, [(h.key, h.value) for h in r.headers],
                    int(r.timestamp.timestamp() * 1000)) for r in df.collect())


def test_batch_read_of_remote_fragments_equals_the_native_read(spark, spark_cluster, tier_config, stream_name):
    url = spark_cluster.metadata_url

    async def prep():
        c = await connect(url)
        try:
            await _make(c, stream_name, n=400)
            before = await _read_all(c, stream_name)
            done = await _offload(c, tier_config, stream_name, 4)
            return before, done
        finally:
            await c.close()

    before, done = asyncio.run(prep())
    assert _rows(_df(spark, url, stream_name)) == before
    assert _rows(_df(spark, url, stream_name, minPartitions="6")) == before  # cut at fragment boundaries
    # an object lost: the query fails naming it, with failOnDataLoss either way
    asyncio.run(ObjectStore(tier_config).delete(done[1][1]))
    for fail in ("true", "false"):
        with pytest.raises(Exception) as ei:
            _df(spark, url, stream_name, failOnDataLoss=fail).collect()
        assert done[1][1] in str(ei.value) and "missing" in str(ei.value)
