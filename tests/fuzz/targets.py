"""The fuzz targets: one function of bytes each, and the contract it checks.

Each target is ``TARGETS[name]``: ``setup()`` (once per process, returns nothing) and ``one(data)``.
``one`` raises ``ContractViolation`` (or any unexpected exception, which is a violation too) when
the code under test broke its contract; every other outcome is fine. The runner
(``tests/fuzz/run.py``) feeds it from atheris (coverage-guided) or, without atheris, from a plain
mutator; the regression tests feed it the exact inputs of past crashes.

* ``kafka_decode``: bytes as a Kafka request frame body (``codec.decode_request``), and as a byte
  stream into ``codec.FrameDecoder``. Contract: a ``Request`` or ``CorruptRequest`` /
  ``UnsupportedRequest`` / ``FrameTooLarge`` (what the server turns into a close), nothing else,
  within ``SLOW_S``; a Produce request the hand-written codec decoded (``produce.py``) equals kio's
  decoding, unless kio refuses its unknown tagged fields (skipped on purpose). Structure-aware modes put a valid header of a supported (api key, version) in
  front of the fuzzed body, or overwrite part of a valid encoding of that pair.
* ``kafka_dispatch``: the same decoding, then ``Broker.prepare`` + ``Broker.handle`` in-process
  against a ``memory://`` metadata store (no bookies: produce/fetch answer their error codes) and
  ``codec.encode_response`` of the answer. Contract: an answer that encodes, or a ``KafkaError``
  / ``ProtocolError`` (the server closes the connection), within ``DISPATCH_TIMEOUT_S``.
* ``bookie_frames``: bytes as a data-plane byte stream (``wire.FrameReader``, chunked), each frame's
  body decoded as the data plane does (``decode_add``, ``READ_REQ`` ...). Contract: frames or
  ``FrameError`` / ``struct.error`` (the connection is answered ERROR and closed); decoded adds lie
  inside their frame and account for every byte of it.
* ``bookie_storage``: bytes as a short program of adds, reads and LAC writes (ledger ids, entry
  ids, terms, LAC/LAFR, flags, digest type and bytes, data) against a real ``Engine`` in a temp dir.
  Contract: an outcome with statuses or a ``BookieError``; an add answered OK reads back as
  written; a protected ledger written at setup (never addressed by the fuzzer) reads back intact;
  every ``REOPEN_EVERY`` inputs the engine is closed and reopened (journal replay) and every
  ledger's state must be what it was before.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

SLOW_S = 2.0  # one decode taking longer than this is a hang
DISPATCH_TIMEOUT_S = 5.0


class ContractViolation(AssertionError):
    pass


def _check_time(started: float, limit: float, what: str) -> None:
    took = time.monotonic() - started
    if took > limit:
        raise ContractViolation(f"{what} took {took:.2f} s (limit {limit} s)")


# ============================================================================ Kafka: decode
_kafka: dict = {}


def kafka_setup() -> None:
    from compat_kafka.wire import codec

    from . import kafka_seeds

    pairs = kafka_seeds.supported_pairs()
    seeds = kafka_seeds.seeds()
    headers = {}
    for key, version in pairs:
        frame = seeds[f"k{key:02d}v{version:02d}"]
        schema = codec.request_schema(key, version)
        from kio.serial import entity_reader

        _header, hsize = entity_reader(schema.__header_schema__)(frame, 0)
        headers[(key, version)] = (frame[:hsize], frame)
    _kafka.update(pairs=pairs, headers=headers)


def kafka_body(data: bytes) -> bytes | None:
    """The request frame body an input stands for (None: the input is a byte stream, mode 3)."""
    if len(data) < 3:
        return data
    mode, pick = data[0] & 3, int.from_bytes(data[1:3], "big")
    pairs = _kafka["pairs"]
    if mode == 0:  # raw bytes as a frame body
        return data[1:]
    header, frame = _kafka["headers"][pairs[pick % len(pairs)]]
    if mode == 1:  # a valid header of a supported pair, then fuzzed body bytes
        return header + data[3:]
    if mode == 2:  # a valid encoding of that pair with fuzzed bytes written over part of it
        if len(data) < 4:
            return frame
        at = len(header) + data[3] % max(1, len(frame) - len(header))
        patch = data[4:]
        return frame[:at] + patch + frame[at + len(patch):]
    return None


def _decode_or_close(body: bytes):
    """``decode_request`` under the contract: the request, or None for an error the server
    answers by closing (or with its UNSUPPORTED_VERSION answer)."""
    from compat_kafka.wire import codec
    from compat_kafka.wire.errors import CorruptRequest, UnsupportedRequest

    started = time.monotonic()
    try:
        req = codec.decode_request(body)
    except (CorruptRequest, UnsupportedRequest) as exc:
        if isinstance(exc, UnsupportedRequest) and exc.api_key == codec.API_API_VERSIONS:
            codec.unsupported_api_versions_response(exc.correlation_id)
        _check_time(started, SLOW_S, "a rejected decode")
        return None
    _check_time(started, SLOW_S, "a decode")
    from kio.serial import entity_reader

    from compat_kafka.wire import guard, produce

    schema = codec.request_schema(req.api_key, req.api_version)
    fast = req.api_key == codec.API_PRODUCE and produce.FIRST <= req.api_version <= produce.LAST
    try:
        _h, hsize = entity_reader(schema.__header_schema__)(body, 0)
        _b, bsize = entity_reader(schema)(body, hsize)
    except KeyError as exc:  # kio refuses tagged fields it does not know; produce.py skips them (KIP-482)
        if fast and "Unknown tagged field" in str(exc):
            return req
        raise
    if fast and (req.body != _b or req.client_id != _h.client_id):
        raise ContractViolation(f"produce.py decoded {req!r}, kio {_h!r} {_b!r}")
    if guard.walk_end(schema, body) != hsize + bsize:
        raise ContractViolation(f"the length guard walked to {guard.walk_end(schema, body)}, kio to {hsize + bsize}")
    lo, hi = codec.SUPPORTED[req.api_key]
    if not lo <= req.api_version <= hi or req.body.__api_key__ != req.api_key:
        raise ContractViolation(f"decoded {req.api_key} v{req.api_version} as {type(req.body)}")
    return req


def kafka_decode(data: bytes) -> None:
    from compat_kafka.wire import codec
    from compat_kafka.wire.errors import FrameTooLarge

    body = kafka_body(data)
    if body is not None:
        _decode_or_close(body)
        return
    # mode 3: a byte stream, cut in chunks, through the frame decoder (small limit: 4 KiB)
    dec = codec.FrameDecoder(4096)
    stream, step = data[3:], 1 + data[1] % 64
    try:
        for i in range(0, len(stream), step):
            for f in dec.feed(stream[i:i + step]):
                if not 10 <= len(f) <= 4096:
                    raise ContractViolation(f"a frame of {len(f)} bytes passed the 10..4096 limit")
                _decode_or_close(f)
    except FrameTooLarge:
        return
    if dec.pending_bytes > 4 + 4096:
        raise ContractViolation(f"{dec.pending_bytes} bytes buffered, over one frame")


# ============================================================================ Kafka: dispatch
_dispatch: dict = {}


def kafka_dispatch_setup() -> None:
    kafka_setup()
    import logging

    from compat_kafka.broker import Broker, BrokerConfig
    from compat_kafka.groups.consumer_groups import ConsumerGroupConfig
    from compat_kafka.groups.coordinator import GroupConfig
    from compat_kafka.partitions.partition import PartitionConfig  # noqa: F401 - imported for the handlers
    from streams.client import connect

    logging.disable(logging.CRITICAL)  # handlers log answered errors; the fuzzer's output stays readable
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    groups = GroupConfig(initial_rebalance_delay_ms=0,
                         consumer=ConsumerGroupConfig(session_timeout_ms=1000, heartbeat_interval_ms=200))
    config = BrokerConfig(port=9092, max_fetch_wait_ms=50, max_produce_timeout_ms=500, groups=groups,
                          rebalance=False, lease_ttl_s=60.0)

    async def start():
        client = await connect("memory://", add_timeout_s=0.5, call_timeout_s=0.5)
        broker = Broker(client, config)
        await broker.start(9092, [("PLAINTEXT", 9092)])
        return broker

    _dispatch.update(loop=loop, broker=loop.run_until_complete(start()))


def kafka_dispatch(data: bytes) -> None:
    from compat_kafka.wire import codec
    from compat_kafka.wire.errors import KafkaError, ProtocolError

    body = kafka_body(data)
    if body is None:
        body = data[3:]
    req = _decode_or_close(body)
    if req is None or req.api_key in (codec.API_SASL_HANDSHAKE, codec.API_SASL_AUTHENTICATE):
        return  # SASL is answered by the server's read loop, never by a handler
    broker, loop = _dispatch["broker"], _dispatch["loop"]

    async def one():
        codec.set_connection_auth(codec.ConnectionAuth())
        codec.set_listener("PLAINTEXT")
        broker.prepare(req)
        answer = await broker.handle(req)
        if answer is not None:
            codec.encode_response(req.correlation_id, answer)
        elif not (req.api_key == codec.API_PRODUCE and req.body.acks == 0):
            raise ContractViolation(f"no answer to api key {req.api_key} v{req.api_version}")

    started = time.monotonic()
    try:
        loop.run_until_complete(asyncio.wait_for(one(), DISPATCH_TIMEOUT_S))
    except (KafkaError, ProtocolError):
        pass  # answered with an error code / the server closes the connection
    except TimeoutError as exc:
        raise ContractViolation(f"api key {req.api_key} v{req.api_version} not answered in "
                                f"{DISPATCH_TIMEOUT_S} s") from exc
    _check_time(started, DISPATCH_TIMEOUT_S + 1, "a dispatch")


# ============================================================================ bookie: frames
def bookie_frames_setup() -> None:
    from bookie import wire  # noqa: F401


def bookie_frames(data: bytes) -> None:
    from bookie import wire

    if not data:
        return
    step = 1 + data[0] % 97
    stream = data[1:]
    reader = wire.FrameReader(max_frame_bytes=1 << 16)
    frames = []
    started = time.monotonic()
    try:
        for i in range(0, len(stream), step):
            frames += reader.feed(stream[i:i + step])
    except wire.FrameError:
        pass
    if reader.buffered > 4 + (1 << 16) + step:
        raise ContractViolation(f"{reader.buffered} bytes buffered, over one frame")
    for op, _rid, body in frames:
        try:
            if op == wire.ADD:
                cols = wire.decode_add(body)
                n = len(cols[0])
                if any(len(c) != n for c in cols):
                    raise ContractViolation("add columns of different lengths")
                used = wire.COUNT.size + n * wire.ADD_HEAD.size + sum(len(d) for d in cols[8]) + sum(
                    len(d) for d in cols[9])
                if used != len(body):
                    raise ContractViolation(f"adds account for {used} of {len(body)} bytes")
            elif op == wire.READ:
                wire.READ_REQ.unpack(body)
            elif op == wire.READ_LAC:
                wire.READ_LAC_REQ.unpack(body)
            elif op == wire.WRITE_LAC:
                wire.WRITE_LAC_REQ.unpack(body)
            elif op == wire.AUTH:
                wire.decode_auth(body)
        except (wire.FrameError, struct.error):
            pass
    _check_time(started, SLOW_S, "parsing")


# ============================================================================ bookie: storage
PROTECTED = 4242  # the ledger written at setup; the fuzzer never addresses it
REOPEN_EVERY = 300
_store: dict = {}
_LEDGERS = (0, 1, 2, 3, -1, (1 << 63) - 1, -(1 << 63))


def _engine(data_dir: Path):
    from bookie.storage import Engine
    from tests.bookie.helpers import small_config

    engine = Engine(small_config(data_dir, flush_interval_s=3600.0))
    engine.open()
    return engine


def _protected_entries():
    return [(i, b"protected-%d" % i * (i + 1)) for i in range(6)]


def bookie_storage_setup() -> None:
    from bookie import digest

    root = Path(tempfile.mkdtemp(prefix="scroll-fuzz-storage-"))
    engine = _engine(root / "data")
    ents = _protected_entries()
    n = len(ents)
    out = engine.add_batch([PROTECTED] * n, [i for i, _ in ents], [3] * n, [-1] * n, [-1] * n, [True] + [False] * (n - 1),
                           [False] * n, [0] * n, [digest.crc32c_digest(PROTECTED, i, d) for i, d in ents],
                           [d for _, d in ents])
    assert out.statuses is None, out
    engine.flush()  # half on disk, half in the write cache
    engine.write_lac(PROTECTED, 3, 2, 2)
    _store.update(root=root, engine=engine, inputs=0, protected_state=engine.state(PROTECTED))
    import atexit

    atexit.register(lambda: shutil.rmtree(root, ignore_errors=True))


def _check_protected(engine) -> None:
    res = engine.read_range(PROTECTED, 0, 100)
    got = [(eid, bytes(e[3])) for eid, e in res.entries]
    if got != _protected_entries():
        raise ContractViolation(f"the protected ledger reads back {got}")
    if engine.state(PROTECTED) != _store["protected_state"]:
        raise ContractViolation(f"the protected ledger's state is now {engine.state(PROTECTED)}")


class _Input:
    """Reads ints off the fuzz input; zeros once it runs out."""

    def __init__(self, data: bytes) -> None:
        self.data, self.off = data, 0

    def take(self, n: int) -> bytes:
        b = self.data[self.off:self.off + n]
        self.off += n
        return b.ljust(n, b"\0")

    def u8(self) -> int:
        return self.take(1)[0]

    def i64(self) -> int:
        return int.from_bytes(self.take(8), "little", signed=True)

    def small(self) -> int:
        """Mostly small ids around the interesting edges, sometimes any int64."""
        k = self.u8()
        if k < 200:
            return k % 8 - 1  # -1..6
        return self.i64()

    @property
    def more(self) -> bool:
        return self.off < len(self.data)


def bookie_storage(data: bytes) -> None:
    from bookie import digest, wire
    from bookie.errors import BookieError

    engine = _store["engine"]
    src = _Input(data)
    for _ in range(8):
        if not src.more:
            break
        op = src.u8() % 4
        pick = src.u8()
        lid = _LEDGERS[pick % len(_LEDGERS)] if pick < 224 else src.i64()
        if lid == PROTECTED:
            lid += 1
        try:
            if op in (0, 1):  # a batch of adds, encoded and decoded as the data plane does
                n = 1 + src.u8() % 4
                parts, size = [], 0
                for _a in range(n):
                    eid, term, lac, lafr = src.small(), src.small(), src.small(), src.small()
                    flags, dtype = src.u8(), src.u8() % 3
                    payload = src.take(src.u8() % 64)
                    dig = (digest.crc32c_digest(lid, eid, payload) if dtype == 0 and src.u8() < 200 and lid >= 0 and eid >= 0
                           else src.take([4, 16, src.u8() % 20][dtype]))
                    p, s = wire.add_entry(lid, eid, term, lac, lafr, bool(flags & 1), bool(flags & 2), dtype, dig, payload)
                    parts += p
                    size += s
                frame = b"".join(bytes(x) for x in wire.add_frame(1, n, size, parts))
                cols = wire.decode_add(memoryview(frame)[wire.FRAME.size:])
                out = engine.add_batch(*cols)
                _check_adds(engine, cols, out)
            elif op == 2:  # a read, plain or capped
                first, last = src.small(), src.small()
                engine.read_range(lid, first, last, src.u8() % 8, src.u8() * 16)
            else:
                engine.write_lac(lid, src.small(), src.small(), src.small())
        except BookieError:
            pass
    _check_protected(engine)
    _store["inputs"] += 1
    if engine.write_cache.bytes > 256 * 1024:
        engine.flush()
    if _store["inputs"] % REOPEN_EVERY == 0:
        _reopen()


def _check_adds(engine, cols, out) -> None:
    """Each add answered OK reads back as written, unless a later add of the batch rewrote it."""
    lids, eids, datas = cols[0], cols[1], cols[9]
    ok = [out.statuses is None or s == 0 for s in (out.statuses or lids)]
    last = {}
    for i, (lid, eid) in enumerate(zip(lids, eids)):
        if ok[i]:
            last[(lid, eid)] = i
    for (lid, eid), i in last.items():
        if any(lids[j] == lid and ok[j] and cols[5][j] for j in range(i + 1, len(lids))):
            continue  # truncated by a later add of the batch
        got = engine.read_entry(lid, eid)
        if got is None or bytes(got.data) != bytes(datas[i]):
            raise ContractViolation(f"ledger {lid} entry {eid} answered OK but reads back {got}")


def _reopen() -> None:
    engine = _store["engine"]
    states = dict(engine.states)
    engine.close()
    engine = _engine(_store["root"] / "data")
    if dict(engine.states) != states:
        changed = {k: (states.get(k), engine.states.get(k)) for k in set(states) | set(engine.states)
                   if states.get(k) != engine.states.get(k)}
        raise ContractViolation(f"ledger states changed across a reopen (journal replay): {changed}")
    _store["engine"] = engine
    _check_protected(engine)
    if sum(f.stat().st_size for f in _store["root"].rglob("*") if f.is_file()) > 512 << 20:
        raise ContractViolation("the storage directory grew over 512 MiB")


TARGETS = {
    "kafka_decode": (kafka_setup, kafka_decode, ("compat_kafka.wire",)),
    "kafka_dispatch": (kafka_dispatch_setup, kafka_dispatch, ("compat_kafka", "streams.topics")),
    "bookie_frames": (bookie_frames_setup, bookie_frames, ("bookie.wire",)),
    "bookie_storage": (bookie_storage_setup, bookie_storage, ("bookie", "terms")),
}

os.environ.setdefault("SCROLL_MALLOC_TUNING", "0")
