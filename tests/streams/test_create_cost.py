"""Creating a stream (issue 26's scale curves: 100k streams): one etcd transaction writes the
stream and its topic record, and the answer is what was written (no read-back). Counted with etcd's
own request counters against the session's real etcd."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from fragments.model import LedgerConfig
from streams.client import connect
from streams.errors import StreamExists, TopicExists
from streams.topics import topic_key
from tests.streams.test_idle import _etcd_requests

N = 20
KV = ("Range", "Txn", "Put", "DeleteRange")


def test_a_stream_and_its_topic_record_are_one_etcd_write(cluster):
    async def main():
        client = await connect(cluster.metadata_url)
        prefix = f"cost-{uuid.uuid4().hex[:8]}"
        try:
            await client.create_stream(f"{prefix}-warm")  # the bookie listing and a block of ledger ids
            before = _etcd_requests(cluster)
            infos = [await client.create_stream(f"{prefix}-{i}", retention={"max_age_s": 60}) for i in range(N)]
            after = _etcd_requests(cluster)
            kv = sum(after.get(k, 0) - before.get(k, 0) for k in KV)
            # one transaction each, a little slack for a bookie listing a second old and the
            # session's bookies (seven requests each before)
            assert kv <= N + 6, {k: after.get(k, 0) - before.get(k, 0) for k in KV}
            for i, info in enumerate(infos):
                name = f"{prefix}-{i}"
                read = await client.describe_stream(name)  # the answer is what etcd holds
                assert (info.meta, info.fragments) == (read.meta, read.fragments)
                assert await client.cluster.store.get(topic_key(name)) is not None  # its topic record
            with pytest.raises(TopicExists):
                await client.create_stream(f"{prefix}-0")
            with pytest.raises(TopicExists):
                await client.create_topic(f"{prefix}-0", 3)
            assert (await client.describe_stream(f"{prefix}-0")).meta == infos[0].meta  # left as it was

            # a stream some tool made without a topic record: StreamExists, and a Kafka-style create
            # that reuses streams adopts it and writes the record
            lone = f"{prefix}-lone"
            await client.cluster.ledgers.create_ledger(lone, LedgerConfig(3, 3, 2),
                                                       tuple(infos[0].fragments[0].ensemble))
            with pytest.raises(StreamExists) as exc:
                await client.create_stream(lone)
            assert not isinstance(exc.value, TopicExists)
            assert await client.cluster.store.get(topic_key(lone)) is None  # the failed create wrote nothing
            await client.create_topic(lone, 1, reuse_streams=True)
            assert await client.cluster.store.get(topic_key(lone)) is not None
            with pytest.raises(TopicExists):
                await client.create_topic(lone, 1, reuse_streams=True)
        finally:
            await client.close()

    asyncio.run(main())
