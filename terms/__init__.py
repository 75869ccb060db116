"""The sans-IO protocol core of Scroll's unbounded ledgers.

Everything here is synchronous and deterministic: events in, commands out; randomness and time
are passed in. The same objects run in the asyncio drivers (``streams``), in the bookie server and
in the deterministic simulator (``tests/sim``). Nothing here imports asyncio, grpc, etcd or rocksdb.
"""
