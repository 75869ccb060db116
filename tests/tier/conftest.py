"""A real SeaweedFS S3 server for the tier's tests: one per test module, on free loopback ports,
with credentials; stopped even when a test fails."""

from __future__ import annotations

import asyncio

import pytest

from streams.tier.objstore import ObjectStore
from streams.tier.seaweed import SeaweedS3
from tests.ports import port_block

ACCESS_KEY = "scroll-test"
SECRET_KEY = "s3cr3t-Do-Not-Print-7d1f"


def seaweed_on_free_ports(data_dir, **kwargs) -> SeaweedS3:
    base = port_block(8)
    return SeaweedS3(data_dir, s3_port=base, master_port=base + 1, volume_port=base + 2, filer_port=base + 3,
                     master_grpc_port=base + 4, volume_grpc_port=base + 5, filer_grpc_port=base + 6,
                     s3_grpc_port=base + 7, **kwargs)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    s = seaweed_on_free_ports(tmp_path_factory.mktemp("seaweed"), credentials=(ACCESS_KEY, SECRET_KEY))
    try:
        s.start()
        yield s
    finally:
        s.stop()


@pytest.fixture
def object_store(seaweed) -> ObjectStore:
    return ObjectStore(seaweed.tier_config())


def run(coro):
    return asyncio.run(coro)
