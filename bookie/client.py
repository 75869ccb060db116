"""Async client of one bookie, with add batching; answers are the events of ``terms.messages``.

How this works. Adds go over one bidirectional gRPC stream per client. ``submit`` (a list of
``AddRequest``) or ``submit_columns`` appends the adds to the newest *open batch* and returns one
future for them. A sender task sends the oldest open batch the moment the pipe is idle, i.e. when
fewer than ``max_inflight_batches`` batches await their answer; while it waits (a write in
progress, or the in-flight limit reached) new adds gather in the open batch, up to
``max_batch_adds`` / ``max_batch_bytes``. So a lone add goes out at once and a busy client sends
few, large messages. A reader task matches each ``AddBatchResult`` to its batch by id and resolves
the futures. If the stream breaks, or an answer takes longer than ``add_timeout_s``, every add not
yet answered resolves as failed (``WriteFailed``) and the next add opens a fresh stream.

The client computes each add's digest: CRC32C, or the MAC when ``set_password`` gave the ledger a
password; reads verify digests (CRC32C always, MACs when the key is known).

Answers for protocol calls are the sans-IO core's events (``AddOk``, ``InvalidTerm``,
``NotTruncated``, ``WriteFailed``, ``FenceOk``, ``FenceFailed``, ``ReadOk``, ``ReadMissing``,
``ReadFailed``) with ``bookie`` set to this client's bookie name, ready to feed to the core.
Regular reads, long-poll LAC reads, trims and info raise typed ``BookieError``s instead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from terms.messages import (
    AddOk,
    AddRequest,
    FenceFailed,
    FenceOk,
    InvalidTerm,
    NotTruncated,
    ReadFailed,
    ReadMissing,
    ReadOk,
    WriteFailed,
)

from . import digest as digests
from .errors import BookieError, BookieUnavailableError, CorruptEntryError, Status, TooLargeError, error_for
from .proto import bookie_pb2 as pb
from .proto import bookie_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MiB = 1 << 20
UNAVAILABLE = -1  # client-side status: the stream broke or timed out before an answer came


# ------------------------------------------------------------------------------ results


@dataclass(frozen=True, slots=True)
class AddResults:
    """Answers to one submitted group of adds, in order. ``statuses`` None means all OK."""

    count: int
    statuses: list[int] | None = None
    bookie_terms: list[int] | None = None
    error: str = ""

    @property
    def all_ok(self) -> bool:
        return self.statuses is None

    def status(self, i: int) -> int:
        return Status.OK if self.statuses is None else self.statuses[i]

    def event(self, i: int, req: AddRequest, bookie: str):
        code = self.status(i)
        if code == Status.OK:
            return AddOk(bookie, req.ledger_id, req.entry_id, req.term)
        if code == Status.INVALID_TERM:
            return InvalidTerm(bookie, req.ledger_id, req.term, self.bookie_terms[i])
        if code == Status.NOT_TRUNCATED:
            return NotTruncated(bookie, req.ledger_id, req.entry_id, req.term)
        return WriteFailed(bookie, req.ledger_id, req.entry_id, req.term)

    def events(self, reqs: Sequence[AddRequest], bookie: str) -> list:
        if self.statuses is None:
            return [AddOk(bookie, r.ledger_id, r.entry_id, r.term) for r in reqs]
        return [self.event(i, r, bookie) for i, r in enumerate(reqs)]


@dataclass(frozen=True, slots=True)
class Entry:
    entry_id: int
    entry_term: int  # the term of the add that wrote this copy
    data: bytes
    digest_type: int = digests.DIGEST_CRC32C
    digest: bytes = b""


@dataclass(frozen=True, slots=True)
class ReadResult:
    lac: int
    lafr: int
    entries: list[Entry]  # contiguous from the first id asked
    stop: Status  # why the run ended: OK (range or a limit reached), NO_SUCH_ENTRY, CORRUPT
    term: int = -1  # the bookie's term for the ledger


@dataclass(frozen=True, slots=True)
class LacResult:
    lac: int
    lafr: int
    timed_out: bool
    term: int = -1  # the bookie's term for the ledger


@dataclass(frozen=True, slots=True)
class LacWritten:
    bookie: str
    ledger_id: int
    term: int


@dataclass(frozen=True, slots=True)
class BookieInfo:
    bookie_id: str
    free_bytes: int
    used_bytes: int
    read_only: bool
    read_only_reason: str
    ledgers: int
    write_cache_bytes: int
    version: str


# ------------------------------------------------------------------------------ batching


class _OpenBatch:
    __slots__ = ("cols", "waiters", "n", "nbytes", "any_flag", "timer")

    def __init__(self) -> None:
        self.cols: tuple[list, ...] = tuple([] for _ in range(10))
        self.waiters: list[tuple[asyncio.Future, int]] = []  # (future, count), in order
        self.n = 0
        self.nbytes = 0
        self.any_flag = [False, False, False]  # truncate, recovery, MAC seen
        self.timer: asyncio.TimerHandle | None = None

    def to_message(self, batch_id: int) -> pb.AddBatch:
        c = self.cols
        return pb.AddBatch(
            batch_id=batch_id, ledger_id=c[0], entry_id=c[1], term=c[2], lac=c[3], lafr=c[4],
            truncate=c[5] if self.any_flag[0] else (), recovery=c[6] if self.any_flag[1] else (),
            digest_type=c[7] if self.any_flag[2] else (), digest=c[8], data=c[9],
        )


class _AddStream:
    """One Add call: the sender, the reader and the batches in flight."""

    def __init__(self, client: BookieClient) -> None:
        self.client = client
        self.call = client._stub.Add()
        self.open: collections.deque[_OpenBatch] = collections.deque()
        self.inflight: dict[int, _OpenBatch] = {}
        self.next_id = 1
        self.wake = asyncio.Event()
        self.dead = False
        loop = asyncio.get_running_loop()
        self.sender = loop.create_task(self._send_loop(), name="bookie-add-sender")
        self.reader = loop.create_task(self._read_loop(), name="bookie-add-reader")

    def enqueue(self, cols: tuple[Sequence, ...], nbytes: int, flags: tuple[bool, bool, bool]) -> asyncio.Future:
        c = self.client
        k = len(cols[0])
        ob = self.open[-1] if self.open else None
        if ob is None or ob.n + k > c.max_batch_adds or (ob.n and ob.nbytes + nbytes > c.max_batch_bytes):
            ob = _OpenBatch()
            self.open.append(ob)
        for dst, src in zip(ob.cols, cols):
            dst.extend(src)
        for i in range(3):
            ob.any_flag[i] = ob.any_flag[i] or flags[i]
        fut = asyncio.get_running_loop().create_future()
        ob.waiters.append((fut, k))
        ob.n += k
        ob.nbytes += nbytes
        self.wake.set()
        return fut

    async def _send_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self.dead:
                await self.wake.wait()
                self.wake.clear()
                while self.open and len(self.inflight) < self.client.max_inflight_batches:
                    ob = self.open.popleft()
                    bid = self.next_id
                    self.next_id += 1
                    self.inflight[bid] = ob
                    ob.timer = loop.call_later(self.client.add_timeout_s, self._check_timeout, bid)
                    await self.call.write(ob.to_message(bid))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.fail(f"add stream write failed: {exc!r}")

    async def _read_loop(self) -> None:
        try:
            while True:
                res = await self.call.read()
                if res is grpc.aio.EOF:
                    self.fail("add stream closed by the bookie")
                    return
                self._resolve(res)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.fail(f"add stream broke: {_describe(exc)}")

    def _resolve(self, res: pb.AddBatchResult) -> None:
        ob = self.inflight.pop(res.batch_id, None)
        if ob is None:
            log.warning("bookie %s answered unknown add batch %d", self.client.bookie, res.batch_id)
            return
        if ob.timer is not None:
            ob.timer.cancel()
        if res.all_ok:
            for fut, k in ob.waiters:
                if not fut.done():
                    fut.set_result(AddResults(k))
        else:
            statuses, terms = list(res.status), list(res.bookie_term)
            if len(statuses) != ob.n:
                statuses = [Status.INTERNAL] * ob.n
                terms = [-1] * ob.n
            start = 0
            for fut, k in ob.waiters:
                if not fut.done():
                    fut.set_result(AddResults(k, statuses[start : start + k], terms[start : start + k], res.error))
                start += k
        self.wake.set()

    def _check_timeout(self, bid: int) -> None:
        if bid in self.inflight and not self.dead:
            self.fail(f"no answer to add batch {bid} within {self.client.add_timeout_s}s")

    def fail(self, reason: str, quiet: bool = False) -> None:
        """Every add not yet answered fails; the client will open a new stream."""
        if self.dead:
            return
        self.dead = True
        if self.inflight or self.open or not quiet:
            log.warning("bookie %s: %s", self.client.bookie, reason)
        batches = list(self.inflight.values()) + list(self.open)
        self.inflight.clear()
        self.open.clear()
        for ob in batches:
            for fut, k in ob.waiters:
                if not fut.done():
                    fut.set_result(AddResults(k, [UNAVAILABLE] * k, [-1] * k, reason))
        self.call.cancel()
        self.wake.set()
        if self.client._stream is self:
            self.client._stream = None

    async def close(self) -> None:
        self.fail("client closed", quiet=True)
        for task in (self.sender, self.reader):
            task.cancel()
        await asyncio.gather(self.sender, self.reader, return_exceptions=True)
        # let gRPC take the cancelled call's status: its own status task would otherwise still be
        # pending when an owner stops the loop ("Task was destroyed but it is pending!")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.call.code(), 2.0)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)


# ------------------------------------------------------------------------------ the client


async def _merge(futs: list[asyncio.Future]) -> AddResults:
    parts = await asyncio.gather(*futs)
    n = sum(p.count for p in parts)
    if all(p.all_ok for p in parts):
        return AddResults(n)
    statuses: list[int] = []
    terms: list[int] = []
    for p in parts:
        statuses.extend(p.statuses if p.statuses is not None else [Status.OK] * p.count)
        terms.extend(p.bookie_terms if p.bookie_terms is not None else [-1] * p.count)
    return AddResults(n, statuses, terms, "; ".join(p.error for p in parts if p.error))


class BookieClient:
    """Talk to one bookie. Use as ``async with BookieClient(addr) as c:`` or call ``close()``."""

    def __init__(
        self,
        address: str,
        *,
        bookie: str | None = None,
        max_batch_adds: int = 2000,
        max_batch_bytes: int = 4 * MiB,
        max_inflight_batches: int = 8,
        max_entry_bytes: int = 1 * MiB,
        max_message_bytes: int = 64 * MiB,
        add_timeout_s: float = 30.0,
        call_timeout_s: float = 30.0,
    ) -> None:
        self.address = address
        self.bookie = bookie or address
        self.max_batch_adds = max_batch_adds
        self.max_batch_bytes = max_batch_bytes
        self.max_inflight_batches = max_inflight_batches
        self.max_entry_bytes = max_entry_bytes
        self.add_timeout_s = add_timeout_s
        self.call_timeout_s = call_timeout_s
        self._keys: dict[int, bytes] = {}
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                # a bookie that restarts is back within a couple of seconds: do not let gRPC's
                # default reconnect backoff (up to 120 s) keep failing calls to it fast. (Not
                # grpc.min_reconnect_backoff_ms: gRPC also uses it as the connect timeout, and at
                # 100 ms connections to a busy bookie failed with "connect() timed out".)
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self._stub = pb_grpc.BookieStub(self._channel)
        self._stream: _AddStream | None = None
        self._calls: set = set()  # unary calls not yet finished

    async def __aenter__(self) -> BookieClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel every call still running and wait until gRPC has finished each (closing the
        channel alone cancels them but leaves their status tasks pending on the loop)."""
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
        calls = list(self._calls)
        for call in calls:
            call.cancel()
        if calls:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*(c.code() for c in calls), return_exceptions=True), 2.0)
        await self._channel.close()

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except TimeoutError as exc:
            raise BookieUnavailableError(f"bookie {self.address} not reachable within {timeout_s}s") from exc

    def set_password(self, ledger_id: int, password: bytes | None) -> None:
        """Use a keyed MAC for this ledger's digests (None: back to CRC32C)."""
        if password is None:
            self._keys.pop(ledger_id, None)
        else:
            self._keys[ledger_id] = digests.mac_key(password)

    # ---------------------------------------------------------------- adds

    def submit(self, reqs: Sequence[AddRequest]) -> asyncio.Future:
        """Queue adds; the future resolves to ``AddResults`` (one status per add, in order)."""
        return self.submit_columns(
            [r.ledger_id for r in reqs], [r.entry_id for r in reqs], [r.term for r in reqs],
            [r.lac for r in reqs], [r.lafr for r in reqs], [r.data for r in reqs],
            truncates=[r.truncate for r in reqs], recoveries=[r.recovery for r in reqs],
        )

    def submit_columns(self, ledger_ids, entry_ids, terms, lacs, lafrs, datas, truncates=None, recoveries=None) -> asyncio.Future:
        """The columnar form of ``submit`` (no AddRequest objects needed)."""
        n = len(ledger_ids)
        too_big = [i for i, d in enumerate(datas) if len(d) > self.max_entry_bytes]
        if too_big:
            return self._refuse(n, too_big, f"entry over max_entry_bytes={self.max_entry_bytes}")
        dtypes, digest_col = self._digests(ledger_ids, entry_ids, datas)
        truncates = truncates if truncates is not None else [False] * n
        recoveries = recoveries if recoveries is not None else [False] * n
        flags = (any(truncates), any(recoveries), any(dtypes))
        cols = (ledger_ids, entry_ids, terms, lacs, lafrs, truncates, recoveries, dtypes, digest_col, datas)
        if self._stream is None or self._stream.dead:
            self._stream = _AddStream(self)
        chunks = list(self._chunks(datas))
        if len(chunks) == 1:
            return self._stream.enqueue(cols, chunks[0][2], flags)
        # A submission larger than one batch (e.g. an ensemble change resending a whole window)
        # goes out as several batches, each within the limits, and answers as one AddResults.
        futs = [self._stream.enqueue(tuple(c[a:b] for c in cols), nb, flags) for a, b, nb in chunks]
        return asyncio.ensure_future(_merge(futs))

    def _chunks(self, datas):
        """(start, end, bytes) runs of at most max_batch_adds adds and max_batch_bytes bytes."""
        start, nbytes = 0, 0
        for i, d in enumerate(datas):
            if i > start and (i - start >= self.max_batch_adds or nbytes + len(d) > self.max_batch_bytes):
                yield start, i, nbytes
                start, nbytes = i, 0
            nbytes += len(d)
        yield start, len(datas), nbytes

    def _digests(self, ledger_ids, entry_ids, datas) -> tuple[list[int], list[bytes]]:
        keys = self._keys
        crc = digests.crc32c_digest
        if not keys:
            return [0] * len(ledger_ids), [crc(lid, eid, d) for lid, eid, d in zip(ledger_ids, entry_ids, datas)]
        dtypes, out = [], []
        for lid, eid, d in zip(ledger_ids, entry_ids, datas):
            key = keys.get(lid)
            dtypes.append(digests.DIGEST_MAC if key else digests.DIGEST_CRC32C)
            out.append(digests.mac_digest(key, lid, eid, d) if key else crc(lid, eid, d))
        return dtypes, out

    def _refuse(self, n: int, bad: list[int], reason: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        statuses = [UNAVAILABLE] * n
        for i in bad:
            statuses[i] = Status.TOO_LARGE
        fut.set_result(AddResults(n, statuses, [-1] * n, reason))
        return fut

    async def add(self, req: AddRequest):
        """One add; answers AddOk, InvalidTerm, NotTruncated or WriteFailed."""
        res = await self.submit([req])
        return res.event(0, req, self.bookie)

    async def add_many(self, reqs: Sequence[AddRequest]) -> list:
        res = await self.submit(reqs)
        return res.events(reqs, self.bookie)

    # ---------------------------------------------------------------- term-carrying unary calls

    async def fence(self, ledger_id: int, term: int):
        """Answers FenceOk(lac, lafr), InvalidTerm or FenceFailed."""
        try:
            r = await self._tracked(self._stub.Fence, pb.FenceRequest(ledger_id=ledger_id, term=term))
        except grpc.aio.AioRpcError as exc:
            log.warning("fence ledger=%d term=%d on %s failed: %s", ledger_id, term, self.bookie, _describe(exc))
            return FenceFailed(self.bookie, ledger_id, term)
        if r.status == Status.OK:
            return FenceOk(self.bookie, ledger_id, term, r.lac, r.lafr)
        if r.status == Status.INVALID_TERM:
            return InvalidTerm(self.bookie, ledger_id, term, r.bookie_term)
        log.warning("fence ledger=%d term=%d on %s: %s %s", ledger_id, term, self.bookie, Status(r.status).name, r.error)
        return FenceFailed(self.bookie, ledger_id, term)

    async def recovery_read(self, ledger_id: int, entry_id: int, term: int):
        """Answers ReadOk(entry_term, data), ReadMissing, InvalidTerm or ReadFailed."""
        req = pb.RecoveryReadRequest(ledger_id=ledger_id, entry_id=entry_id, term=term)
        try:
            r = await self._tracked(self._stub.RecoveryRead, req)
        except grpc.aio.AioRpcError as exc:
            log.warning("recovery read ledger=%d entry=%d term=%d failed: %s", ledger_id, entry_id, term, _describe(exc))
            return ReadFailed(self.bookie, ledger_id, entry_id, term)
        if r.status == Status.OK:
            if not self._verify(ledger_id, entry_id, r.digest_type, r.data, r.digest):
                log.error("recovery read ledger=%d entry=%d from %s: digest mismatch", ledger_id, entry_id, self.bookie)
                return ReadFailed(self.bookie, ledger_id, entry_id, term)
            return ReadOk(self.bookie, ledger_id, entry_id, term, r.entry_term, r.data)
        if r.status == Status.NO_SUCH_ENTRY:
            return ReadMissing(self.bookie, ledger_id, entry_id, term)
        if r.status == Status.INVALID_TERM:
            return InvalidTerm(self.bookie, ledger_id, term, r.bookie_term)
        log.warning("recovery read ledger=%d entry=%d: %s %s", ledger_id, entry_id, Status(r.status).name, r.error)
        return ReadFailed(self.bookie, ledger_id, entry_id, term)

    async def write_lac(self, ledger_id: int, term: int, lac: int, lafr: int):
        """Answers LacWritten, InvalidTerm, NotTruncated (entry_id = lac) or WriteFailed."""
        req = pb.WriteLacRequest(ledger_id=ledger_id, term=term, lac=lac, lafr=lafr)
        try:
            r = await self._tracked(self._stub.WriteLac, req)
        except grpc.aio.AioRpcError as exc:
            log.warning("LAC write ledger=%d term=%d failed: %s", ledger_id, term, _describe(exc))
            return WriteFailed(self.bookie, ledger_id, lac, term)
        if r.status == Status.OK:
            return LacWritten(self.bookie, ledger_id, term)
        if r.status == Status.INVALID_TERM:
            return InvalidTerm(self.bookie, ledger_id, term, r.bookie_term)
        if r.status == Status.NOT_TRUNCATED:
            return NotTruncated(self.bookie, ledger_id, lac, term)
        return WriteFailed(self.bookie, ledger_id, lac, term)

    # ---------------------------------------------------------------- reads, trims, info

    async def read(self, ledger_id: int, first: int, last: int | None = None, *, max_entries: int = 0, max_bytes: int = 0) -> ReadResult:
        """Entries first..last (contiguous prefix, bounded by the limits) and the bookie's LAC.
        Raises NoSuchLedgerError, NoSuchEntryError (first id absent), CorruptEntryError (first
        id corrupt), or another BookieError."""
        req = pb.ReadRequest(
            ledger_id=ledger_id, first_entry_id=first, last_entry_id=first if last is None else last,
            max_entries=max_entries, max_bytes=max_bytes,
        )
        r = await self._unary(self._stub.Read, req)
        if r.status != Status.OK:
            raise error_for(r.status, r.error or f"read ledger {ledger_id} entry {first}")
        entries, stop = [], Status(r.stop_status)
        for eid, term, dtype, dig, data in zip(r.entry_id, r.entry_term, r.digest_type, r.digest, r.data):
            if not self._verify(ledger_id, eid, dtype, data, dig):
                stop = Status.CORRUPT
                break
            entries.append(Entry(eid, term, data, dtype, dig))
        if not entries:
            raise CorruptEntryError(f"ledger {ledger_id} entry {first}: digest mismatch")
        return ReadResult(r.lac, r.lafr, entries, stop, r.bookie_term)

    async def read_lac(self, ledger_id: int, after_lac: int = -1, timeout_s: float = 0.0) -> LacResult:
        """The ledger's LAC; with a timeout, waits until it is > after_lac (long poll)."""
        req = pb.ReadLacRequest(ledger_id=ledger_id, after_lac=after_lac, timeout_ms=int(timeout_s * 1000))
        r = await self._unary(self._stub.ReadLac, req, extra_s=timeout_s)
        if r.status != Status.OK:
            raise error_for(r.status, r.error or f"read LAC of ledger {ledger_id}")
        return LacResult(r.lac, r.lafr, r.timed_out, r.bookie_term)

    async def trim(self, ledger_id: int, first: int, last: int) -> None:
        """Delete the ledger's entries with first <= id <= last (retention)."""
        req = pb.TrimRequest(ledger_id=ledger_id, first_entry_id=first, last_entry_id=last)
        r = await self._unary(self._stub.Trim, req)
        if r.status != Status.OK:
            raise error_for(r.status, r.error)

    async def delete_ledger(self, ledger_id: int) -> None:
        r = await self._unary(self._stub.Trim, pb.TrimRequest(ledger_id=ledger_id, whole_ledger=True))
        if r.status != Status.OK:
            raise error_for(r.status, r.error)

    async def info(self) -> BookieInfo:
        r = await self._unary(self._stub.Info, pb.InfoRequest())
        return BookieInfo(
            r.bookie_id, r.free_bytes, r.used_bytes, r.read_only, r.read_only_reason, r.ledgers, r.write_cache_bytes, r.version
        )

    def _tracked(self, method, req, extra_s: float = 0.0):
        """Start a unary call, kept in ``_calls`` until gRPC has its status, even when the task
        awaiting it was cancelled (a losing speculative read): close() waits for them."""
        call = method(req, timeout=self.call_timeout_s + extra_s)
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        return call

    async def _unary(self, method, req, extra_s: float = 0.0):
        try:
            return await self._tracked(method, req, extra_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise TooLargeError(_describe(exc)) from exc
            raise BookieUnavailableError(f"bookie {self.bookie}: {_describe(exc)}") from exc

    def _verify(self, ledger_id: int, entry_id: int, dtype: int, data: bytes, dig: bytes) -> bool:
        return digests.verify(dtype, ledger_id, entry_id, data, dig, self._keys.get(ledger_id))


__all__ = [
    "AddResults",
    "BookieClient",
    "BookieError",
    "BookieInfo",
    "Entry",
    "LacResult",
    "LacWritten",
    "ReadResult",
    "UNAVAILABLE",
]
