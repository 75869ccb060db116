"""Kafka transactions (KIP-98): the transaction coordinator, transaction markers, and the
per-partition transaction index (ongoing transactions, last stable offset, aborted ranges).

How this works. Three layers.

``TxnMeta`` and the functions ``init_txn`` / ``add_to_txn`` / ``end_txn`` / ``complete_txn`` /
``expire_txn`` are the coordinator state machine of one transactional id, sans-IO: each takes the
current state (or None), the request's producer id/epoch and the time, and returns the next state or
raises the Kafka error to answer. The states are Kafka's: Empty -> Ongoing (AddPartitionsToTxn /
AddOffsetsToTxn) -> PrepareCommit | PrepareAbort (EndTxn, or a timeout, or an InitProducerId that
fences an ongoing transaction) -> CompleteCommit | CompleteAbort (every marker written) -> Ongoing
again on the next add. InitProducerId gives a transactional id one producer id, kept across inits,
and bumps the epoch each time (a new producer id when the epoch would pass 32766): an older epoch
is fenced (PRODUCER_FENCED, or INVALID_PRODUCER_EPOCH for the API versions before KIP-588).

``TransactionCoordinator`` is the asyncio layer. The state of each transactional id is durable in
the metadata store, one key per id::

    kafka/txn/<transactional id, percent-encoded> -> JSON TxnMeta

written compare-and-set on the version this coordinator last read or wrote, so a coordinator that
lost its transactional id (its lease lapsed and another listener took the id over) fails its next
write and answers NOT_COORDINATOR. A coordinator loading an id bumps ``coordinator_epoch`` in that
key (one more CAS): markers carry it, and a partition refuses markers with an older coordinator
epoch than it has seen for that producer (TRANSACTION_COORDINATOR_FENCED), so an old coordinator
cannot write a late marker either. Only the listener that holds the coordinator key of type 1
(``Broker.is_coordinator``) serves an id; the others answer NOT_COORDINATOR.

EndTxn writes PrepareCommit/PrepareAbort (durable), then the markers, then Complete*. Markers are
control record batches (``control_batch``) appended to every partition of the transaction: by this
listener for the partitions it owns, by WriteTxnMarkers (API 27) to the owner for the others. A
marker that fails is retried (back-off up to 1 s) until it is written; the state stays Prepare* in
the metadata store meanwhile, so a listener that takes the id over after a fail-over finishes the
job (``sweep`` finds Prepare* and expired Ongoing transactions; every listener checks the ids it
has loaded every ``sweep_interval_s`` and all ids every ``orphan_scan_interval_s``, claiming those
whose coordinator is gone). EndTxn is answered once the markers (and the transaction's offsets) are
written — so a read_committed consumer sees the outcome once the client's commit returns — or after
``end_txn_wait_s`` with success anyway (the decision is durable). Complete* is written after the
answer, or, when the producer's next request comes first, completed in memory and made durable by
that request's own compare-and-set (one metadata write less per transaction; a coordinator that
took over and finds Prepare* writes the markers again, which is harmless: a marker with no open
transaction at a partition changes nothing). A request arriving while markers are still being
written waits for them (up to ``end_txn_wait_s``, then CONCURRENT_TRANSACTIONS, which clients
retry).

Produce (``check_produce``): a transactional batch must come from the id's current producer for a
partition added to its ongoing transaction — from memory on the coordinator, else from the id's key
in the store for a transaction's first batch on a partition — so a late batch cannot open a
transaction no coordinator would close.

Offsets in a transaction (``send_offsets_to_transaction``): AddOffsetsToTxn adds the group to the
transaction; TxnOffsetCommit, served by the group's coordinator, keeps the offsets pending in
``kafka/txn-offsets/<group>/<transactional id>`` (written only if the transaction's key is still at
the version that showed it ongoing with that producer id/epoch and group). At commit the
transaction coordinator moves them into the group's committed offsets (``groups.OffsetStore``) and
deletes the key; at abort it deletes the key. Both are idempotent, so a retry after a fail-over is
safe. TxnOffsetCommit v3+ checks the member and generation as OffsetCommit does (KIP-447), and
OffsetFetch with ``require_stable`` answers UNSTABLE_OFFSET_COMMIT for partitions with pending
offsets (``mark_unstable``).

``PartitionTxns`` is the transaction index of one partition, kept by ``PartitionLog`` for the
*acknowledged* batches (it is exact below the high watermark): per producer id the first offset of
its ongoing transaction, the aborted ranges (producer id, first offset, marker offset), and the
coordinator epoch of the last marker. The last stable offset (LSO) is the first offset of the
earliest ongoing transaction, else the high watermark. It is saved in the producer-state snapshot
and rebuilt by the same scan on open (``partition._rebuild_producer_state``).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import struct
import time
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote, unquote

from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from crc32c import crc32c
from kio.schema.errors import ErrorCode

from streams.batches import ATTR_CONTROL, OFF_ATTRIBUTES, OFF_CRC

from ..wire import codec
from ..wire.codec import (
    API_ADD_OFFSETS_TO_TXN,
    API_ADD_PARTITIONS_TO_TXN,
    API_DESCRIBE_TRANSACTIONS,
    API_END_TXN,
    API_LIST_TRANSACTIONS,
    API_TXN_OFFSET_COMMIT,
    API_WRITE_TXN_MARKERS,
    ZERO_MS,
    build,
    nested,
)
from ..wire.errors import (
    InvalidProducerEpoch,
    InvalidRequest,
    KafkaError,
    NotLeaderOrFollower,
    UnknownTopicOrPartition,
    code_for,
)

log = logging.getLogger(__name__)

TXN_PREFIX = "kafka/txn/"
TXN_OFFSETS_PREFIX = "kafka/txn-offsets/"
MAX_EPOCH = 32767

EMPTY = "Empty"
ONGOING = "Ongoing"
PREPARE_COMMIT = "PrepareCommit"
PREPARE_ABORT = "PrepareAbort"
COMPLETE_COMMIT = "CompleteCommit"
COMPLETE_ABORT = "CompleteAbort"
STATES = (EMPTY, ONGOING, PREPARE_COMMIT, PREPARE_ABORT, COMPLETE_COMMIT, COMPLETE_ABORT)


# ---------------------------------------------------------------- errors
class ProducerFenced(KafkaError):
    code = ErrorCode.producer_fenced


class InvalidTxnState(KafkaError):
    code = ErrorCode.invalid_txn_state


class ConcurrentTransactions(KafkaError):
    code = ErrorCode.concurrent_transactions
    retriable = True


class InvalidProducerIdMapping(KafkaError):
    code = ErrorCode.invalid_producer_id_mapping


class InvalidTransactionTimeout(KafkaError):
    code = ErrorCode.invalid_transaction_timeout


class TransactionCoordinatorFenced(KafkaError):
    code = ErrorCode.transaction_coordinator_fenced


class NotCoordinator(KafkaError):
    code = ErrorCode.not_coordinator
    retriable = True


class GroupMembershipError(KafkaError):
    """TxnOffsetCommit from a member the group does not know at that generation (KIP-447)."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


def fenced_code(api_key: int, version: int) -> ErrorCode:
    """KIP-588: PRODUCER_FENCED from these versions on, INVALID_PRODUCER_EPOCH before."""
    first = {codec.API_INIT_PRODUCER_ID: 4, API_ADD_PARTITIONS_TO_TXN: 2, API_ADD_OFFSETS_TO_TXN: 2,
             API_END_TXN: 2, API_TXN_OFFSET_COMMIT: 3}.get(api_key, 99)
    return ErrorCode.producer_fenced if version >= first else ErrorCode.invalid_producer_epoch


def error_code(exc: BaseException, api_key: int, version: int) -> ErrorCode:
    if isinstance(exc, ProducerFenced):
        return fenced_code(api_key, version)
    return code_for(exc)


# ---------------------------------------------------------------- the state machine (sans-IO)
@dataclass(frozen=True)
class TxnMeta:
    transactional_id: str
    producer_id: int
    epoch: int
    state: str = EMPTY
    timeout_ms: int = 60_000
    partitions: frozenset[tuple[str, int]] = frozenset()
    groups: frozenset[str] = frozenset()
    start_ms: int = -1  # when the ongoing transaction began
    updated_ms: int = 0
    coordinator_epoch: int = 0
    last_epoch: int = -1  # the epoch before the last bump (KIP-360 retries of InitProducerId)

    def encode(self) -> bytes:
        return json.dumps({
            "transactional_id": self.transactional_id, "producer_id": self.producer_id, "epoch": self.epoch,
            "state": self.state, "timeout_ms": self.timeout_ms,
            "partitions": sorted([t, p] for t, p in self.partitions), "groups": sorted(self.groups),
            "start_ms": self.start_ms, "updated_ms": self.updated_ms, "coordinator_epoch": self.coordinator_epoch,
            "last_epoch": self.last_epoch}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> TxnMeta:
        d = json.loads(raw)
        state = d["state"]
        if state not in STATES:
            raise ValueError(f"unknown transaction state {state!r}")
        return cls(str(d["transactional_id"]), int(d["producer_id"]), int(d["epoch"]), state, int(d["timeout_ms"]),
                   frozenset((str(t), int(p)) for t, p in d["partitions"]), frozenset(d["groups"]),
                   int(d["start_ms"]), int(d["updated_ms"]), int(d["coordinator_epoch"]), int(d.get("last_epoch", -1)))

    @property
    def preparing(self) -> bool:
        return self.state in (PREPARE_COMMIT, PREPARE_ABORT)

    def expired(self, now_ms: int) -> bool:
        return self.state == ONGOING and now_ms - self.start_ms > self.timeout_ms


def init_txn(meta: TxnMeta | None, txn_id: str, timeout_ms: int, max_timeout_ms: int, now_ms: int,
             producer_id: int = -1, epoch: int = -1, new_producer_id: int | None = None) -> TxnMeta:
    """InitProducerId for ``txn_id``. Returns the next state: Empty at a bumped epoch, or, when a
    transaction is ongoing, PrepareAbort at a bumped epoch (the caller writes its markers, then
    completes it and answers with that epoch). ``new_producer_id``: a fresh id, used for a new
    transactional id and when the epoch is exhausted (the caller allocates it)."""
    if not 0 < timeout_ms <= max_timeout_ms:
        raise InvalidTransactionTimeout(f"transaction timeout {timeout_ms} ms is not in 1..{max_timeout_ms} ms")
    if meta is None:
        if new_producer_id is None:
            raise ValueError("a new transactional id needs a producer id")
        return TxnMeta(txn_id, new_producer_id, 0, EMPTY, timeout_ms, updated_ms=now_ms)
    if meta.preparing:
        raise ConcurrentTransactions(f"transactional id {txn_id!r} is completing a transaction")
    if producer_id >= 0:  # KIP-360: a producer bumping its own epoch must still be the current one
        if producer_id != meta.producer_id or epoch not in (meta.epoch, meta.last_epoch):
            raise ProducerFenced(f"transactional id {txn_id!r}: producer {producer_id} epoch {epoch} is not the "
                                 f"current producer {meta.producer_id} epoch {meta.epoch}")
        if epoch == meta.last_epoch and meta.state != ONGOING:  # a retry of the bump that already happened
            return replace(meta, timeout_ms=timeout_ms, updated_ms=now_ms)
    bumped = _bump(meta, new_producer_id)
    if meta.state == ONGOING:  # fence the old producer and abort its transaction first
        return replace(bumped, state=PREPARE_ABORT, timeout_ms=timeout_ms, updated_ms=now_ms)
    return replace(bumped, state=EMPTY, timeout_ms=timeout_ms, partitions=frozenset(), groups=frozenset(),
                   start_ms=-1, updated_ms=now_ms)


def _bump(meta: TxnMeta, new_producer_id: int | None) -> TxnMeta:
    if meta.epoch + 1 < MAX_EPOCH - 1:
        return replace(meta, epoch=meta.epoch + 1, last_epoch=meta.epoch)
    if new_producer_id is None:
        raise ValueError("the epoch is exhausted: a new producer id is needed")
    return replace(meta, producer_id=new_producer_id, epoch=0, last_epoch=-1)


def needs_new_producer_id(meta: TxnMeta | None) -> bool:
    return meta is None or meta.epoch + 1 >= MAX_EPOCH - 1


def check_producer(meta: TxnMeta | None, txn_id: str, producer_id: int, epoch: int) -> TxnMeta:
    if meta is None:
        raise InvalidProducerIdMapping(f"transactional id {txn_id!r} is unknown: call InitProducerId first")
    if producer_id != meta.producer_id:
        raise InvalidProducerIdMapping(f"transactional id {txn_id!r} has producer id {meta.producer_id}, "
                                       f"not {producer_id}")
    if epoch != meta.epoch:
        raise ProducerFenced(f"transactional id {txn_id!r}: epoch {epoch} is not the current epoch {meta.epoch}")
    return meta


def check_txn_offset_commit(meta: TxnMeta | None, txn_id: str, group: str, producer_id: int,
                            epoch: int) -> TxnMeta:
    """Whether a TxnOffsetCommit (v0-3) may stage offsets in the transaction of ``txn_id``.

    Kafka's rule: the group coordinator does not look the transactional id up itself; since Kafka
    3.6 (KIP-890 part 1, ``transaction.partition.verification.enable``, on by default; 3.9
    ``GroupCoordinator.handleTxnCommitOffsets`` -> ``ReplicaManager.
    maybeStartTransactionVerificationForPartition``) it asks the transaction coordinator to verify
    that the group's offsets partition is in the producer's ongoing transaction
    (``TransactionCoordinator.handleVerifyPartitionsInTransaction``), which answers, in this
    order: unknown transactional id or another producer id -> INVALID_PRODUCER_ID_MAPPING;
    another epoch -> PRODUCER_FENCED; PrepareCommit/PrepareAbort -> CONCURRENT_TRANSACTIONS; the
    offsets partition not in the transaction (no AddOffsetsToTxn) -> TRANSACTION_ABORTABLE, which
    the broker turns into INVALID_TXN_STATE for TxnOffsetCommit below v4 (``AddPartitionsToTxn
    Manager``). So Kafka 3.9 refuses an unknown transactional id as we do; Kafka before 3.6 (or with
    verification off) accepted it and let the producer id and epoch alone guard the write."""
    meta = check_producer(meta, txn_id, producer_id, epoch)
    if meta.preparing:
        raise ConcurrentTransactions(f"transactional id {txn_id!r} is completing a transaction")
    if meta.state != ONGOING or group not in meta.groups:
        raise InvalidTxnState(f"transactional id {txn_id!r}: group {group!r} is not in an ongoing "
                              "transaction (AddOffsetsToTxn first)")
    return meta


def add_to_txn(meta: TxnMeta | None, txn_id: str, producer_id: int, epoch: int, now_ms: int,
               partitions=(), groups=()) -> TxnMeta:
    """AddPartitionsToTxn / AddOffsetsToTxn: the transaction is (or becomes) Ongoing with them."""
    meta = check_producer(meta, txn_id, producer_id, epoch)
    if meta.preparing:
        raise ConcurrentTransactions(f"transactional id {txn_id!r} is completing a transaction")
    if meta.state == ONGOING:
        return replace(meta, partitions=meta.partitions | frozenset(partitions), groups=meta.groups | frozenset(groups),
                       updated_ms=now_ms)
    return replace(meta, state=ONGOING, partitions=frozenset(partitions), groups=frozenset(groups), start_ms=now_ms,
                   updated_ms=now_ms)


def end_txn(meta: TxnMeta | None, txn_id: str, producer_id: int, epoch: int, commit: bool, now_ms: int) -> TxnMeta:
    """EndTxn: Ongoing -> Prepare*; a retry of a finished or finishing EndTxn returns the state as
    is (the caller then waits for it / answers success); anything else is INVALID_TXN_STATE."""
    meta = check_producer(meta, txn_id, producer_id, epoch)
    want_prepare, want_complete = (PREPARE_COMMIT, COMPLETE_COMMIT) if commit else (PREPARE_ABORT, COMPLETE_ABORT)
    if meta.state == ONGOING:
        return replace(meta, state=want_prepare, updated_ms=now_ms)
    if meta.state in (want_prepare, want_complete):
        return meta
    raise InvalidTxnState(f"transactional id {txn_id!r}: cannot {'commit' if commit else 'abort'} in state "
                          f"{meta.state}")


def complete_txn(meta: TxnMeta, now_ms: int) -> TxnMeta:
    """Every marker of a Prepare* transaction is written."""
    if meta.state == PREPARE_COMMIT:
        return replace(meta, state=COMPLETE_COMMIT, updated_ms=now_ms)
    if meta.state == PREPARE_ABORT:
        return replace(meta, state=COMPLETE_ABORT, updated_ms=now_ms)
    raise InvalidTxnState(f"cannot complete a transaction in state {meta.state}")


def expire_txn(meta: TxnMeta, now_ms: int, new_producer_id: int | None = None) -> TxnMeta | None:
    """An Ongoing transaction past its timeout is aborted at a bumped epoch (its producer is
    fenced); None when it has not expired."""
    if not meta.expired(now_ms):
        return None
    return replace(_bump(meta, new_producer_id), state=PREPARE_ABORT, updated_ms=now_ms)


# ---------------------------------------------------------------- control batches
_MARKER_KEY = struct.Struct(">hh")  # version 0, type (0 abort, 1 commit)
_MARKER_VALUE = struct.Struct(">hi")  # version 0, coordinator epoch
_U32 = struct.Struct(">I")


def control_batch(producer_id: int, epoch: int, commit: bool, coordinator_epoch: int,
                  timestamp_ms: int | None = None) -> bytearray:
    """A transaction marker: a transactional control batch of one record. aiokafka's builder makes
    the transactional batch (it never sets the control bit, which only brokers do); the control bit
    is then set and the CRC (over attributes..end) computed again."""
    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    b = DefaultRecordBatchBuilder(2, 0, 1, producer_id, epoch, -1, 1024)
    b.append(0, ts, _MARKER_KEY.pack(0, 1 if commit else 0), _MARKER_VALUE.pack(0, coordinator_epoch), [])
    buf = b.build()
    buf[OFF_ATTRIBUTES + 1] |= ATTR_CONTROL
    _U32.pack_into(buf, OFF_CRC, crc32c(memoryview(buf)[OFF_ATTRIBUTES:]))
    return buf


def parse_marker(batch) -> tuple[bool, int]:
    """(commit, coordinator epoch) of a control batch (a stored batch's bytes)."""
    rec = next(iter(DefaultRecordBatch(bytes(batch))))
    version, kind = _MARKER_KEY.unpack_from(rec.key, 0)
    if kind not in (0, 1):
        raise ValueError(f"control record type {kind} is not a transaction marker")
    coord_epoch = _MARKER_VALUE.unpack_from(rec.value, 0)[1] if rec.value and len(rec.value) >= 6 else 0
    return kind == 1, coord_epoch


# ---------------------------------------------------------------- the partition's transaction index
class PartitionTxns:
    """Ongoing transactions, aborted ranges and marker coordinator epochs of one partition, for
    the acknowledged batches. Aborted ranges are kept in marker order, at most ``max_aborted``
    (the oldest go first; document: a read_committed consumer reading that far back would then see
    aborted records)."""

    def __init__(self, max_aborted: int = 5_000):
        self.max_aborted = max_aborted
        self.ongoing: dict[int, int] = {}  # producer id -> first offset of its ongoing transaction
        self.ongoing_epochs: dict[int, int] = {}  # producer id -> its epoch then (not persisted: -1 after a rebuild)
        self.aborted: list[tuple[int, int, int]] = []  # (producer id, first offset, marker offset)
        self.coordinator_epochs: dict[int, int] = {}  # producer id -> coordinator epoch of its last marker

    def on_batch(self, producer_id: int, base_offset: int, epoch: int = -1) -> None:
        """A transactional data batch was stored."""
        if producer_id not in self.ongoing:
            self.ongoing[producer_id] = base_offset
            self.ongoing_epochs[producer_id] = epoch

    def ongoing_at(self, producer_id: int, epoch: int) -> bool:
        """Whether the producer, at this epoch, has a transaction open here (its batches acknowledged)."""
        return producer_id in self.ongoing and self.ongoing_epochs.get(producer_id) == epoch

    def on_marker(self, producer_id: int, offset: int, commit: bool, coordinator_epoch: int) -> None:
        first = self.ongoing.pop(producer_id, None)
        self.ongoing_epochs.pop(producer_id, None)
        if not commit and first is not None:
            self.aborted.append((producer_id, first, offset))
            if len(self.aborted) > self.max_aborted:
                del self.aborted[: len(self.aborted) - self.max_aborted]
        if coordinator_epoch > self.coordinator_epochs.get(producer_id, -1):
            self.coordinator_epochs[producer_id] = coordinator_epoch

    def lso(self, high_watermark: int) -> int:
        return min(min(self.ongoing.values(), default=high_watermark), high_watermark)

    def aborted_between(self, start: int, end: int) -> list[tuple[int, int]]:
        """(producer id, first offset) of the aborted transactions with data in [start, end). The
        ranges are in marker order, so those ending at or after ``start`` are a suffix."""
        i = bisect.bisect_left(self.aborted, start, key=lambda a: a[2])
        return [(pid, first) for pid, first, _ in self.aborted[i:] if first < end]

    def trim(self, log_start: int) -> None:
        """Forget aborted ranges that ended below the log start (retention removed them)."""
        i = bisect.bisect_left(self.aborted, log_start, key=lambda a: a[2])
        if i:
            del self.aborted[:i]

    def copy(self) -> PartitionTxns:
        t = PartitionTxns(self.max_aborted)
        t.ongoing = dict(self.ongoing)
        t.ongoing_epochs = dict(self.ongoing_epochs)
        t.aborted = list(self.aborted)
        t.coordinator_epochs = dict(self.coordinator_epochs)
        return t

    def to_json(self) -> dict:
        return {"ongoing": {str(k): v for k, v in self.ongoing.items()}, "aborted": [list(a) for a in self.aborted],
                "coordinator_epochs": {str(k): v for k, v in self.coordinator_epochs.items()}}

    @classmethod
    def from_json(cls, d: dict | None, max_aborted: int = 5_000) -> PartitionTxns:
        t = cls(max_aborted)
        if d:
            t.ongoing = {int(k): int(v) for k, v in d.get("ongoing", {}).items()}
            t.aborted = [(int(a), int(b), int(c)) for a, b, c in d.get("aborted", [])]
            t.coordinator_epochs = {int(k): int(v) for k, v in d.get("coordinator_epochs", {}).items()}
        return t


async def pending_offsets(store, group: str) -> set[tuple[str, int]]:
    """The partitions with offsets of ``group`` pending in an open transaction."""
    out = set()
    for _, v in await store.list_prefix(f"{TXN_OFFSETS_PREFIX}{quote(group, safe='')}/"):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            out |= {(t, int(p)) for t, parts in json.loads(v.value)["offsets"].items() for p in parts}
    return out


async def mark_unstable(store, group: str, topics: tuple, topic_cls, part_cls) -> tuple:
    """OffsetFetch with ``require_stable`` (KIP-447): partitions whose offsets are pending in an
    open transaction answer UNSTABLE_OFFSET_COMMIT (the client retries until the transaction
    ends) instead of an offset that is about to change."""
    pending = await pending_offsets(store, group)
    if not pending:
        return topics
    return tuple(topic_cls(name=t.name, partitions=tuple(
        build(part_cls, partition_index=p.partition_index, committed_offset=-1, committed_leader_epoch=-1,
              metadata="", error_code=ErrorCode.unstable_offset_commit)
        if (t.name, p.partition_index) in pending else p for p in t.partitions)) for t in topics)


# ---------------------------------------------------------------- the coordinator (asyncio)
@dataclass(frozen=True)
class TxnConfig:
    max_timeout_ms: int = 900_000  # transaction.max.timeout.ms
    sweep_interval_s: float = 1.0  # how often this coordinator's transactions are checked for timeouts
    orphan_scan_interval_s: float = 5.0  # how often every id in the store is (ids whose coordinator died)
    # ... while the last such scan saw an open (Ongoing or Prepare*) transaction, or a listener came or
    # went since (``listeners_changed``); otherwise (nothing could have been orphaned) this often
    orphan_recheck_s: float = 60.0
    end_txn_wait_s: float = 10.0  # EndTxn answers after the markers, or after this long anyway
    marker_retry_max_s: float = 1.0

    def __post_init__(self):
        if (self.max_timeout_ms < 1 or self.sweep_interval_s <= 0 or self.end_txn_wait_s <= 0
                or self.orphan_scan_interval_s < self.sweep_interval_s
                or self.orphan_recheck_s < self.orphan_scan_interval_s):
            raise ValueError(f"invalid transaction config {self}")


def txn_key(txn_id: str) -> str:
    return f"{TXN_PREFIX}{quote(txn_id, safe='')}"


def txn_offsets_key(txn_id: str, group: str) -> str:
    return f"{TXN_OFFSETS_PREFIX}{quote(group, safe='')}/{quote(txn_id, safe='')}"


@dataclass
class _Loaded:
    meta: TxnMeta | None
    version: int  # of the metadata key (0: absent)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    finishing: asyncio.Task | None = None
    written: asyncio.Event | None = None  # set once the finishing task wrote every marker (and offsets)


class TransactionCoordinator:
    def __init__(self, broker, config: TxnConfig | None = None):
        self.broker = broker
        self.store = broker.store
        self.config = config or TxnConfig()
        self._txns: dict[str, _Loaded] = {}
        self._sweeper: asyncio.Task | None = None
        self._closed = False
        self._scan_wanted = True  # a full scan is due (start, a listener came or went)
        self._open_seen = True  # the last full scan saw a transaction still open

    def handlers(self) -> dict[int, Any]:
        return {
            API_ADD_PARTITIONS_TO_TXN: self.add_partitions_to_txn,
            API_ADD_OFFSETS_TO_TXN: self.add_offsets_to_txn,
            API_END_TXN: self.end_txn,
            API_WRITE_TXN_MARKERS: self.write_txn_markers,
            API_TXN_OFFSET_COMMIT: self.txn_offset_commit,
            API_DESCRIBE_TRANSACTIONS: self.describe_transactions,
            API_LIST_TRANSACTIONS: self.list_transactions,
        }

    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop(), name="kafka-txn-sweeper")

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in [self._sweeper] + [x.finishing for x in self._txns.values()] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def forget(self) -> None:
        """Drop every loaded id (our lease lapsed): the next request loads it again if it is still
        ours. Tasks finishing transactions go on; their writes fail if the id moved."""
        self._txns = {}

    @staticmethod
    def _now_ms() -> int:
        return int(time.time() * 1000)

    # ------------------------------------------------------------ loading and writing state
    async def _load(self, txn_id: str) -> _Loaded:
        """The id's state, as this coordinator knows it. Raises NotCoordinator when another listener
        coordinates it. A first load by this listener bumps the coordinator epoch (CAS), fencing
        the previous coordinator's markers and writes."""
        if not txn_id:
            raise InvalidRequest("an empty transactional id")
        try:
            mine = await self.broker.is_coordinator(1, txn_id)
        except Exception as exc:
            raise NotCoordinator(f"coordinator check failed: {exc!r}") from exc
        if not mine:
            self._txns.pop(txn_id, None)
            raise NotCoordinator(f"transactional id {txn_id!r} is coordinated by another listener")
        cur = self._txns.get(txn_id)
        if cur is not None:
            return cur
        loaded = _Loaded(None, 0)
        self._txns[txn_id] = loaded
        try:
            async with loaded.lock:
                got = await self.store.get(txn_key(txn_id))
                if got is not None:
                    meta = TxnMeta.decode(got.value)
                    meta = replace(meta, coordinator_epoch=meta.coordinator_epoch + 1)
                    v = await self.store.cas(txn_key(txn_id), meta.encode(), got.version)
                    if v is None:
                        raise NotCoordinator(f"transactional id {txn_id!r} changed while loading")
                    loaded.meta, loaded.version = meta, v
                    log.info("txn=%s loaded: producer %d epoch %d state %s coordinator epoch %d", txn_id,
                             meta.producer_id, meta.epoch, meta.state, meta.coordinator_epoch)
                    if meta.preparing:
                        self._finish_later(txn_id, loaded)
        except BaseException:
            self._txns.pop(txn_id, None)
            raise
        return loaded

    async def _write(self, txn_id: str, loaded: _Loaded, meta: TxnMeta) -> None:
        v = await self.store.cas(txn_key(txn_id), meta.encode(), loaded.version)
        if v is None:
            self._txns.pop(txn_id, None)
            raise NotCoordinator(f"transactional id {txn_id!r} was taken over by another coordinator")
        loaded.meta, loaded.version = meta, v

    def state_of(self, txn_id: str) -> TxnMeta | None:
        """The state of an id this listener coordinates (None if not loaded here)."""
        cur = self._txns.get(txn_id)
        return cur.meta if cur is not None else None

    # ------------------------------------------------------------ InitProducerId
    async def init_producer_id(self, txn_id: str, timeout_ms: int, producer_id: int, epoch: int) -> tuple[int, int]:
        loaded = await self._load(txn_id)
        async with loaded.lock:
            await self._not_preparing(loaded, txn_id)
            meta = loaded.meta
            new_pid = await self.broker.producer_ids.allocate() if needs_new_producer_id(meta) else None
            nxt = init_txn(meta, txn_id, timeout_ms, self.config.max_timeout_ms, self._now_ms(), producer_id, epoch,
                           new_pid)
            await self._write(txn_id, loaded, nxt)
            if nxt.state == PREPARE_ABORT:
                log.info("txn=%s: InitProducerId fences epoch %d and aborts its ongoing transaction", txn_id,
                         meta.epoch)
                self._finish_later(txn_id, loaded)
                if not await self._wait_finished(loaded):
                    raise ConcurrentTransactions(f"transactional id {txn_id!r}: aborting the fenced transaction")
                return nxt.producer_id, nxt.epoch
        log.info("txn=%s: producer id %d epoch %d", txn_id, nxt.producer_id, nxt.epoch)
        return nxt.producer_id, nxt.epoch

    async def _wait_finished(self, loaded: _Loaded, markers_only: bool = False) -> bool:
        """Wait (lock released; the caller holds it) up to end_txn_wait_s for a Prepare*
        transaction to complete (``markers_only``: for its markers and offsets to be written)."""
        task = loaded.finishing
        if task is None or task.done():
            return not (loaded.meta and loaded.meta.preparing)
        waiter = loaded.written.wait() if markers_only and loaded.written is not None else asyncio.shield(task)
        loaded.lock.release()
        try:
            await asyncio.wait_for(waiter, self.config.end_txn_wait_s)
        except (TimeoutError, Exception):
            pass
        finally:
            await loaded.lock.acquire()
        if markers_only and loaded.written is not None and loaded.written.is_set():
            return True
        return not (loaded.meta and loaded.meta.preparing)

    async def _not_preparing(self, loaded: _Loaded, txn_id: str, will_write: bool = True) -> None:
        """A request arriving while the last transaction is being completed waits for it (briefly;
        then CONCURRENT_TRANSACTIONS, which the client retries). Once its markers are written, a
        caller that writes the state next (``will_write``) need not wait for the Complete* write:
        the transaction is completed in memory and the caller's compare-and-set makes that durable
        together with its own change (one metadata write less per transaction)."""
        if loaded.meta is not None and loaded.meta.preparing:
            if will_write and loaded.written is not None and loaded.written.is_set():
                loaded.meta = complete_txn(loaded.meta, self._now_ms())
                return
            self._finish_later(txn_id, loaded)
            if not await self._wait_finished(loaded):
                raise ConcurrentTransactions(f"transactional id {txn_id!r} is completing a transaction")

    # ------------------------------------------------------------ AddPartitionsToTxn / AddOffsetsToTxn
    async def add_partitions_to_txn(self, req, resp_cls):
        version = resp_cls.__version__
        topic_cls = nested(resp_cls, "AddPartitionsToTxnTopicResult")
        part_cls = nested(resp_cls, "AddPartitionsToTxnPartitionResult")
        if version >= 4:
            result_cls = nested(resp_cls, "AddPartitionsToTxnResult")
            out = []
            for t in req.transactions:
                codes = await self._add_partitions(t.transactional_id, t.producer_id, t.producer_epoch, t.topics,
                                                   version, t.verify_only)
                out.append(build(result_cls, transactional_id=t.transactional_id, topic_results=self._topic_results(
                    codes, topic_cls, part_cls)))
            return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.none, results_by_transaction=tuple(out))
        codes = await self._add_partitions(req.v3_and_below_transactional_id, req.v3_and_below_producer_id,
                                           req.v3_and_below_producer_epoch, req.v3_and_below_topics, version)
        return build(resp_cls, throttle_time=ZERO_MS,
                     results_by_topic_v3_and_below=self._topic_results(codes, topic_cls, part_cls))

    @staticmethod
    def _topic_results(codes: dict[str, dict[int, ErrorCode]], topic_cls, part_cls) -> tuple:
        return tuple(build(topic_cls, name=name, results_by_partition=tuple(
            build(part_cls, partition_index=p, partition_error_code=c) for p, c in parts.items()))
            for name, parts in codes.items())

    async def _add_partitions(self, txn_id, producer_id, epoch, topics, version: int,
                              verify_only: bool = False) -> dict[str, dict[int, ErrorCode]]:
        wanted = [(t.name, p) for t in topics for p in t.partitions]
        codes: dict[str, dict[int, ErrorCode]] = {}
        bad = {}
        cur = self._txns.get(txn_id)
        known = cur.meta.partitions if cur is not None and cur.meta is not None else frozenset()
        for name in {n for n, p in wanted if (n, p) not in known}:
            meta = await self.broker.topic(name)
            for n, p in wanted:
                if n == name and (meta is None or not 0 <= p < meta.partitions):
                    bad[(n, p)] = ErrorCode.unknown_topic_or_partition
        err: ErrorCode | None = None
        if bad:
            err = ErrorCode.operation_not_attempted
        else:
            try:
                loaded = await self._load(txn_id)
                async with loaded.lock:
                    await self._not_preparing(loaded, txn_id, will_write=not verify_only)
                    if verify_only:  # KIP-890 verification: the partitions must be in the ongoing transaction
                        meta = check_producer(loaded.meta, txn_id, producer_id, epoch)
                        if meta.state != ONGOING or not set(wanted) <= meta.partitions:
                            raise InvalidTxnState(f"transactional id {txn_id!r}: partitions not in the transaction")
                    else:
                        nxt = add_to_txn(loaded.meta, txn_id, producer_id, epoch, self._now_ms(), partitions=wanted)
                        if nxt != loaded.meta:
                            await self._write(txn_id, loaded, nxt)
                err = ErrorCode.none
            except Exception as exc:
                self._log("add_partitions_to_txn", txn_id, exc)
                err = error_code(exc, API_ADD_PARTITIONS_TO_TXN, version)
        for n, p in wanted:
            codes.setdefault(n, {})[p] = bad.get((n, p), err)
        return codes

    async def add_offsets_to_txn(self, req, resp_cls):
        try:
            if not req.group_id:
                raise InvalidRequest("an empty group id")
            loaded = await self._load(req.transactional_id)
            async with loaded.lock:
                await self._not_preparing(loaded, req.transactional_id)
                nxt = add_to_txn(loaded.meta, req.transactional_id, req.producer_id, req.producer_epoch,
                                 self._now_ms(), groups=[req.group_id])
                if nxt != loaded.meta:
                    await self._write(req.transactional_id, loaded, nxt)
            code = ErrorCode.none
        except Exception as exc:
            self._log("add_offsets_to_txn", req.transactional_id, exc)
            code = error_code(exc, API_ADD_OFFSETS_TO_TXN, resp_cls.__version__)
        return build(resp_cls, throttle_time=ZERO_MS, error_code=code)

    # ------------------------------------------------------------ EndTxn
    async def end_txn(self, req, resp_cls):
        txn_id = req.transactional_id
        pid, epoch = req.producer_id, req.producer_epoch
        try:
            loaded = await self._load(txn_id)
            async with loaded.lock:
                nxt = end_txn(loaded.meta, txn_id, pid, epoch, req.committed, self._now_ms())
                if nxt != loaded.meta:
                    await self._write(txn_id, loaded, nxt)
                    log.info("txn=%s producer %d epoch %d: %s (%d partitions, %d groups)", txn_id, pid, epoch,
                             nxt.state, len(nxt.partitions), len(nxt.groups))
                if nxt.preparing:
                    self._finish_later(txn_id, loaded)
                    if not await self._wait_finished(loaded, markers_only=True):
                        log.warning("txn=%s: markers not all written after %.1f s; answering EndTxn, finishing "
                                    "in the background", txn_id, self.config.end_txn_wait_s)
            code = ErrorCode.none
        except Exception as exc:
            self._log("end_txn", txn_id, exc)
            code = error_code(exc, API_END_TXN, resp_cls.__version__)
        return build(resp_cls, throttle_time=ZERO_MS, error_code=code, producer_id=pid, producer_epoch=epoch)

    # ------------------------------------------------------------ finishing: markers, offsets, Complete*
    def _finish_later(self, txn_id: str, loaded: _Loaded) -> None:
        if loaded.finishing is None or loaded.finishing.done():
            loaded.written = asyncio.Event()
            loaded.finishing = asyncio.get_running_loop().create_task(self._finish(txn_id, loaded),
                                                                      name=f"kafka-txn-finish-{txn_id}")

    async def _finish(self, txn_id: str, loaded: _Loaded) -> None:
        meta = loaded.meta
        commit = meta.state == PREPARE_COMMIT
        delay = 0.05
        pending = set(meta.partitions)
        while True:
            if self._closed:
                return
            try:
                pending = await self._write_markers(meta, commit, pending)
                if not pending:
                    await self._settle_offsets(meta, commit)
                    version = loaded.version
                    loaded.written.set()  # EndTxn can be answered: read_committed consumers see the outcome
                    async with loaded.lock:
                        if loaded.meta is meta:
                            await self._write(txn_id, loaded, complete_txn(meta, self._now_ms()))
                        elif loaded.version == version and loaded.meta.state in (COMPLETE_COMMIT, COMPLETE_ABORT):
                            await self._write(txn_id, loaded, loaded.meta)  # completed in memory, not yet written
                        else:  # the next request's write completed it (``_not_preparing``)
                            return
                    log.info("txn=%s producer %d epoch %d: %s", txn_id, meta.producer_id, meta.epoch,
                             loaded.meta.state)
                    return
            except (NotCoordinator, TransactionCoordinatorFenced) as exc:
                log.info("txn=%s: no longer its coordinator (%s); leaving it to the new one", txn_id, exc)
                self._txns.pop(txn_id, None)
                return
            except Exception as exc:
                log.warning("txn=%s: finishing failed, retrying: %r", txn_id, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.marker_retry_max_s)

    async def _write_markers(self, meta: TxnMeta, commit: bool, partitions: set) -> set:
        """Write the markers; returns the partitions still to do."""
        by_owner: dict[int | None, list[tuple[str, int]]] = {}
        for tp in sorted(partitions):
            key = partition_key_of(*tp)
            if self.broker.ownership.owns(key):
                node = None
            else:
                owner = await self.broker.ownership.owner(key)
                node = None if owner is None or owner.node_id == self.broker.node_id else owner.node_id
            by_owner.setdefault(node, []).append(tp)
        left = set()
        for node, tps in by_owner.items():
            if node is None:
                results = await asyncio.gather(*(self.write_marker_local(t, p, meta.producer_id, meta.epoch, commit,
                                                                          meta.coordinator_epoch) for t, p in tps),
                                               return_exceptions=True)
            else:
                log.info("txn=%s: markers for %d partitions sent to node %d", meta.transactional_id, len(tps), node)
                results = await self._write_markers_remote(node, meta, commit, tps)
            for tp, r in zip(tps, results, strict=True):
                if isinstance(r, TransactionCoordinatorFenced):
                    raise r
                if isinstance(r, UnknownTopicOrPartition):  # deleted since: nothing to mark
                    log.info("txn=%s: %s partition %d is gone; no marker", meta.transactional_id, *tp)
                elif isinstance(r, BaseException):
                    log.info("txn=%s: marker for %s partition %d not written yet: %r", meta.transactional_id, *tp, r)
                    left.add(tp)
        return left

    async def write_marker_local(self, topic: str, index: int, producer_id: int, epoch: int, commit: bool,
                                 coordinator_epoch: int) -> None:
        plog = await self.broker.partition(topic, index, write=True)
        try:
            fut = await plog.append_marker(producer_id, epoch, commit, coordinator_epoch)
        except InvalidProducerEpoch as exc:  # a later epoch's marker is there already: nothing to do
            log.info("%s partition %d: marker skipped: %s", topic, index, exc)
            return
        await fut

    async def _write_markers_remote(self, node: int, meta: TxnMeta, commit: bool, tps) -> list:
        from kio.schema.write_txn_markers.v1 import request as wreq

        topics: dict[str, list[int]] = {}
        for t, p in tps:
            topics.setdefault(t, []).append(p)
        body = wreq.WriteTxnMarkersRequest(markers=(wreq.WritableTxnMarker(
            producer_id=meta.producer_id, producer_epoch=meta.epoch, transaction_result=commit,
            topics=tuple(wreq.WritableTxnMarkerTopic(name=t, partition_indexes=tuple(ps)) for t, ps in topics.items()),
            coordinator_epoch=meta.coordinator_epoch),))
        try:
            info = next(b for b in await self.broker.ownership.brokers() if b.node_id == node)
            resp = await self.broker.inter_broker.call(info, body, timeout_s=15.0)
        except Exception as exc:
            return [NotLeaderOrFollower(f"node {node}: {exc!r}")] * len(tps)
        codes = {(t.name, p.partition_index): p.error_code for m in resp.markers for t in m.topics
                 for p in t.partitions}
        out = []
        for tp in tps:
            c = codes.get(tp, ErrorCode.unknown_server_error)
            if c == ErrorCode.none:
                out.append(None)
            elif c == ErrorCode.transaction_coordinator_fenced:
                out.append(TransactionCoordinatorFenced(f"node {node} saw a later coordinator epoch"))
            elif c == ErrorCode.unknown_topic_or_partition:
                out.append(UnknownTopicOrPartition(f"node {node}: unknown partition"))
            else:
                out.append(KafkaError(f"node {node} answered {c.name}"))
        return out

    async def _settle_offsets(self, meta: TxnMeta, commit: bool) -> None:
        from ..groups.records import Committed

        for group in sorted(meta.groups):
            key = txn_offsets_key(meta.transactional_id, group)
            cur = await self.store.get(key)
            if cur is None:
                continue
            d = json.loads(cur.value)
            if commit and int(d["producer_id"]) == meta.producer_id:
                offsets = {(t, int(p)): Committed(int(o["offset"]), int(o.get("leader_epoch", -1)),
                                                  o.get("metadata") or "", int(o.get("commit_timestamp_ms", 0)))
                           for t, parts in d["offsets"].items() for p, o in parts.items()}
                await self.broker.groups.offsets.commit(group, offsets)
                log.info("txn=%s: committed %d offsets of group %s", meta.transactional_id, len(offsets), group)
            await self.store.delete(key, cur.version)

    # ------------------------------------------------------------ WriteTxnMarkers (from another coordinator)
    async def write_txn_markers(self, req, resp_cls):
        result_cls = nested(resp_cls, "WritableTxnMarkerResult")
        topic_cls = nested(resp_cls, "WritableTxnMarkerTopicResult")
        part_cls = nested(resp_cls, "WritableTxnMarkerPartitionResult")
        out = []
        for m in req.markers:
            topics = []
            for t in m.topics:
                jobs = [self.write_marker_local(t.name, p, m.producer_id, m.producer_epoch, m.transaction_result,
                                                m.coordinator_epoch) for p in t.partition_indexes]
                results = await asyncio.gather(*jobs, return_exceptions=True)
                parts = []
                for p, r in zip(t.partition_indexes, results, strict=True):
                    if isinstance(r, BaseException):
                        self._log("write_txn_markers", f"{t.name}/{p}", r)
                    parts.append(build(part_cls, partition_index=p,
                                       error_code=code_for(r) if isinstance(r, BaseException) else ErrorCode.none))
                topics.append(build(topic_cls, name=t.name, partitions=tuple(parts)))
            out.append(build(result_cls, producer_id=m.producer_id, topics=tuple(topics)))
        return build(resp_cls, markers=tuple(out))

    # ------------------------------------------------------------ TxnOffsetCommit (at the group coordinator)
    async def txn_offset_commit(self, req, resp_cls):
        version = resp_cls.__version__
        topic_cls = nested(resp_cls, "TxnOffsetCommitResponseTopic")
        part_cls = nested(resp_cls, "TxnOffsetCommitResponsePartition")
        try:
            await self._txn_offset_commit(req)
            code = ErrorCode.none
        except Exception as exc:
            self._log("txn_offset_commit", req.transactional_id, exc)
            code = error_code(exc, API_TXN_OFFSET_COMMIT, version)
        return build(resp_cls, throttle_time=ZERO_MS, topics=tuple(
            build(topic_cls, name=t.name, partitions=tuple(build(part_cls, partition_index=p.partition_index,
                                                                 error_code=code) for p in t.partitions))
            for t in req.topics))

    async def _txn_offset_commit(self, req) -> None:
        group, txn_id = req.group_id, req.transactional_id
        if not group:
            raise InvalidRequest("an empty group id")
        if not await self.broker.is_coordinator(0, group):
            raise NotCoordinator(f"group {group!r} is coordinated by another listener")
        if hasattr(req, "generation_id"):  # v3+ (KIP-447): the member must be in the group's generation
            groups = self.broker.groups
            g = groups.groups.get(group)
            # a KIP-848 consumer group (``consumer_groups`` on main since the groups merge): the
            # generation is its member epoch, checked as OffsetCommit v9 does
            cg = getattr(groups, "consumer_groups", {}).get(group)
            if cg is not None and (cg.members or req.generation_id >= 0):
                code = cg.check_commit(req.member_id, req.generation_id, 9)
                if code != ErrorCode.none:
                    raise GroupMembershipError(code, f"group {group!r}: member {req.member_id!r} epoch "
                                                     f"{req.generation_id}: {code.name}")
            elif g is not None:
                code = g.check_commit(groups._now(), member_id=req.member_id, generation=req.generation_id,
                                      instance_id=req.group_instance_id)
                if code != ErrorCode.none:
                    raise GroupMembershipError(code, f"group {group!r}: member {req.member_id!r} generation "
                                                     f"{req.generation_id}: {code.name}")
            elif req.generation_id >= 0:
                raise GroupMembershipError(ErrorCode.illegal_generation,
                                           f"group {group!r} has no generation {req.generation_id} here")
        now = self._now_ms()
        for _ in range(5):
            got = await self.store.get(txn_key(txn_id))
            meta = check_txn_offset_commit(TxnMeta.decode(got.value) if got else None, txn_id, group,
                                           req.producer_id, req.producer_epoch)
            key = txn_offsets_key(txn_id, group)
            cur = await self.store.get(key)
            offsets: dict = {}
            if cur is not None:
                d = json.loads(cur.value)
                if int(d["producer_id"]) == meta.producer_id and int(d["start_ms"]) == meta.start_ms:
                    offsets = d["offsets"]
            for t in req.topics:
                for p in t.partitions:
                    offsets.setdefault(t.name, {})[str(p.partition_index)] = {
                        "offset": p.committed_offset, "leader_epoch": getattr(p, "committed_leader_epoch", -1),
                        "metadata": p.committed_metadata or "", "commit_timestamp_ms": now}
            value = json.dumps({"producer_id": meta.producer_id, "epoch": meta.epoch, "start_ms": meta.start_ms,
                                "offsets": offsets}).encode()
            res = await self.store.txn({txn_key(txn_id): got.version, key: cur.version if cur else 0}, {key: value})
            if res.succeeded:
                return
        raise ConcurrentTransactions(f"transactional id {txn_id!r} kept changing")

    # ------------------------------------------------------------ produce checks
    async def check_produce(self, txn_id: str, producer_id: int, epoch: int, topic: str, index: int,
                            ongoing_here: bool) -> None:
        """A transactional produce: the producer must be the current one of ``txn_id`` and the
        partition in its ongoing transaction (else INVALID_PRODUCER_ID_MAPPING /
        INVALID_PRODUCER_EPOCH / INVALID_TXN_STATE). Checked from memory when this listener
        coordinates the id; otherwise from the id's durable state in the metadata store, once per
        transaction and partition (``ongoing_here``: the producer has a transaction open on the
        partition already, nothing to check). AddPartitionsToTxn writes the partition there before
        it answers, so a batch arriving after its transaction ended cannot open a transaction the
        coordinator would never close (a "hanging" one holding the LSO back; KIP-890 does this in
        Kafka by asking the coordinator)."""
        cur = self._txns.get(txn_id)
        if cur is not None and cur.meta is not None and not self.broker.ownership.owns(coordinator_key_of(txn_id)):
            self._txns.pop(txn_id, None)  # moved: our copy may be stale
            cur = None
        if cur is not None and cur.meta is not None:
            meta = cur.meta
        elif ongoing_here:
            return
        else:
            got = await self.store.get(txn_key(txn_id))
            if got is None:
                raise InvalidProducerIdMapping(f"transactional id {txn_id!r} is unknown")
            meta = TxnMeta.decode(got.value)
        if producer_id != meta.producer_id:
            raise InvalidProducerIdMapping(f"transactional id {txn_id!r} has producer id {meta.producer_id}")
        if epoch < meta.epoch:
            raise InvalidProducerEpoch(f"transactional id {txn_id!r}: epoch {epoch} is fenced (current {meta.epoch})")
        if meta.state != ONGOING or (topic, index) not in meta.partitions:
            raise InvalidTxnState(f"transactional id {txn_id!r}: {topic} partition {index} is not in an ongoing "
                                  "transaction (AddPartitionsToTxn first)")

    # ------------------------------------------------------------ DescribeTransactions / ListTransactions
    async def describe_transactions(self, req, resp_cls):
        import datetime

        state_cls = nested(resp_cls, "TransactionState")
        topic_cls = nested(resp_cls, "TopicData")
        out = []
        for txn_id in req.transactional_ids:
            meta, code = None, ErrorCode.none
            try:
                loaded = await self._load(txn_id)
                meta = loaded.meta
                if meta is None:
                    self._txns.pop(txn_id, None)
                    code = ErrorCode.transactional_id_not_found
            except Exception as exc:
                self._log("describe_transactions", txn_id, exc)
                code = code_for(exc)
            topics: dict[str, list[int]] = {}
            for t, p in sorted(meta.partitions if meta else ()):
                topics.setdefault(t, []).append(p)
            # as Kafka: -1 when no transaction began, the schema's default 0 for an error
            start = 0 if meta is None else meta.start_ms if meta.state != EMPTY else -1
            out.append(build(
                state_cls, error_code=code, transactional_id=txn_id,
                transaction_state=meta.state if meta else "", producer_id=meta.producer_id if meta else -1,
                producer_epoch=meta.epoch if meta else -1,
                transaction_timeout=datetime.timedelta(milliseconds=meta.timeout_ms if meta else 0),
                transaction_start_time=datetime.datetime.fromtimestamp(start / 1000, datetime.UTC),
                topics=tuple(build(topic_cls, topic=t, partitions=tuple(ps)) for t, ps in topics.items())))
        return build(resp_cls, throttle_time=ZERO_MS, transaction_states=tuple(out))

    async def list_transactions(self, req, resp_cls):
        """The transactions this listener coordinates (the holder of the id's coordinator key, or
        the preferred listener when none holds it), as a Kafka broker lists those of its
        transaction-log partitions; clients ask every broker and merge."""
        import re

        from ..cluster.ownership import TXN_COORDINATORS

        state_cls = nested(resp_cls, "TransactionState")
        wanted = set(req.state_filters)
        unknown = tuple(sorted(wanted - set(STATES)))
        pids = set(req.producer_id_filters)
        min_ms = getattr(req, "duration_filter", -1)
        pattern = getattr(req, "transactional_id_pattern", None)
        now = self._now_ms()
        try:
            regex = re.compile(pattern) if pattern else None
            own = self.broker.ownership
            live = await own.brokers(max_age_s=0.5)
            holders = await own.owners(TXN_COORDINATORS)
            out = []
            for _key, v in await self.store.list_prefix(TXN_PREFIX):
                try:
                    meta = TxnMeta.decode(v.value)
                except (ValueError, KeyError, TypeError):
                    continue
                txn_id = meta.transactional_id
                ckey = coordinator_key_of(txn_id)
                node = own.owner_among(ckey, holders.get(ckey), live)
                if node is not None and node.node_id != self.broker.node_id:
                    continue
                if wanted and meta.state not in wanted or pids and meta.producer_id not in pids:
                    continue
                if min_ms >= 0 and (meta.state == EMPTY or now - meta.start_ms < min_ms):
                    continue
                if regex is not None and not regex.fullmatch(txn_id):
                    continue
                out.append(build(state_cls, transactional_id=txn_id, producer_id=meta.producer_id,
                                 transaction_state=meta.state))
            code = ErrorCode.none
        except re.error as exc:
            log.info("list_transactions: bad pattern %r: %s", pattern, exc)
            out, code = [], ErrorCode.invalid_request
        except Exception as exc:
            log.warning("list_transactions: %r", exc)
            out, code = [], code_for(exc)
        return build(resp_cls, throttle_time=ZERO_MS, error_code=code, unknown_state_filters=unknown,
                     transaction_states=tuple(out))

    # ------------------------------------------------------------ timeouts and fail-over
    async def _sweep_loop(self) -> None:
        last_scan = 0.0
        loop = asyncio.get_running_loop()
        c = self.config
        while not self._closed:
            await asyncio.sleep(c.sweep_interval_s)
            wanted = False
            try:
                since = loop.time() - last_scan
                # ids are orphaned only by a listener that went away: while the last full scan saw no
                # open transaction and no listener came or went, it is not repeated (an idle cluster
                # costs no listing) until orphan_recheck_s
                everything = since >= c.orphan_scan_interval_s and (
                    self._scan_wanted or self._open_seen or since >= c.orphan_recheck_s)
                if everything:
                    last_scan = loop.time()
                    wanted, self._scan_wanted = self._scan_wanted, False
                await self.sweep(everything)
            except Exception as exc:
                self._scan_wanted = self._scan_wanted or wanted  # failed: the next one is still due
                log.warning("transaction sweep failed: %r", exc)

    def listeners_changed(self) -> None:
        """A listener registered or went away: its transactions may need a coordinator (the next
        full scan runs at its usual time)."""
        self._scan_wanted = True

    async def sweep(self, everything: bool = True) -> None:
        """Abort expired transactions and finish Prepare* ones: of the ids this listener has
        loaded, and (``everything``) of every id in the store, claiming those whose coordinator is
        gone when this listener is the preferred one."""
        now = self._now_ms()
        if everything:
            candidates = []
            for key, v in await self.store.list_prefix(TXN_PREFIX):
                try:
                    candidates.append((unquote(key[len(TXN_PREFIX):]), TxnMeta.decode(v.value)))
                except (ValueError, KeyError, TypeError):
                    continue
            self._open_seen = any(m.preparing or m.state == ONGOING for _t, m in candidates)
        else:
            candidates = [(t, x.meta) for t, x in list(self._txns.items()) if x.meta is not None]
        for txn_id, meta in candidates:
            if not (meta.preparing or meta.expired(now)):
                continue
            if meta.preparing and (x := self._txns.get(txn_id)) is not None and x.finishing is not None \
                    and not x.finishing.done():
                continue  # being finished here already
            try:
                loaded = await self._load(txn_id)
            except NotCoordinator:
                continue
            async with loaded.lock:
                cur = loaded.meta
                if cur is None:
                    continue
                if cur.preparing:
                    self._finish_later(txn_id, loaded)
                    continue
                new_pid = await self.broker.producer_ids.allocate() if needs_new_producer_id(cur) else None
                nxt = expire_txn(cur, self._now_ms(), new_pid)
                if nxt is not None:
                    log.info("txn=%s producer %d epoch %d: timed out after %d ms; aborting at epoch %d", txn_id,
                             cur.producer_id, cur.epoch, cur.timeout_ms, nxt.epoch)
                    await self._write(txn_id, loaded, nxt)
                    self._finish_later(txn_id, loaded)

    def _log(self, what: str, txn_id: str, exc: BaseException) -> None:
        if isinstance(exc, KafkaError):
            log.info("%s txn=%s: %s", what, txn_id, exc)
        else:
            log.warning("%s txn=%s: %r", what, txn_id, exc)


def coordinator_key_of(txn_id: str) -> str:
    from ..cluster.ownership import coordinator_key

    return coordinator_key(1, txn_id)


def partition_key_of(topic: str, index: int) -> str:
    from ..cluster.ownership import partition_key

    return partition_key(topic, index)
