"""Idempotent producers: durable producer ids, and per-partition sequence dedup.

Producer ids. ``InitProducerId`` hands out ids from one counter in the metadata store,
``kafka/producer-ids`` (the next id never handed out, decimal). A shim reserves a block of
``block_size`` ids with one compare-and-set and then serves ids from memory, so the call is cheap;
ids are unique across shims and restarts (the unused rest of a block is simply skipped). A new id
starts at epoch 0. A request (v3+) carrying an existing id and epoch gets the same id at epoch + 1
(KIP-360: the producer bumps its epoch to reset its sequences after an error); an epoch that
would overflow gets a fresh id instead. Transactional ids are the transaction coordinator's
(``compat_kafka.transactions``), which allocates their producer ids here too.

Sequence state. Per (producer id, partition) Kafka keeps the epoch and the last 5 batches'
(first sequence, last sequence, base offset); ``ProducerStateTable`` is that table for one
partition. A batch is checked against it before it is queued (``check``):

* an older epoch -> INVALID_PRODUCER_EPOCH;
* a newer epoch must start at sequence 0, else OUT_OF_ORDER_SEQUENCE_NUMBER;
* the same epoch: a batch equal to one of the last 5 is a duplicate (a retry of a batch already
  stored): it is answered with success and the original base offset, and not stored again; a
  batch whose first sequence follows the last one is appended; anything else is
  OUT_OF_ORDER_SEQUENCE_NUMBER;
* an unknown producer id must start at sequence 0. With a non-zero sequence the answer is
  UNKNOWN_PRODUCER_ID when the table is complete (the producer's state was lost, e.g. to retention:
  clients reset their id/sequence and go on); when the table was rebuilt from a bounded scan and may
  be missing producers, the batch is accepted as Kafka >= 2.5 does for producers without state.

The partition keeps two tables: the *live* one, updated as batches are queued (so pipelined
requests are checked against batches still in flight; a duplicate of an in-flight batch waits for
the original's acknowledgement), and the *acked* one, updated as batches are acknowledged (in
offset order) — the only one written to snapshots, since it describes exactly what is in the log.
See ``compat_kafka.partition`` for how the state is snapshotted and rebuilt on open.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass

from ..wire.errors import InvalidProducerEpoch, OutOfOrderSequenceNumber, UnknownProducerId

PRODUCER_ID_KEY = "kafka/producer-ids"
PRODUCER_STATE_PREFIX = "kafka/producer-state/"
BATCHES_KEPT = 5  # as Kafka: the last 5 batches per producer (max.in.flight for idempotence)
MAX_EPOCH = 32767


def state_key(topic: str, partition: int) -> str:
    return f"{PRODUCER_STATE_PREFIX}{topic}/{partition}"


class ProducerIdAllocator:
    """Producer ids from the metadata store counter, reserved ``block_size`` at a time."""

    def __init__(self, store, block_size: int = 1000):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.store = store
        self.block_size = block_size
        self._next = 0
        self._end = 0
        self._lock = asyncio.Lock()

    async def allocate(self) -> int:
        async with self._lock:
            if self._next >= self._end:
                await self._reserve()
            pid = self._next
            self._next += 1
            return pid

    async def _reserve(self) -> None:
        while True:
            cur = await self.store.get(PRODUCER_ID_KEY)
            start = int(cur.value) if cur else 0
            end = start + self.block_size
            if await self.store.cas(PRODUCER_ID_KEY, str(end).encode(), cur.version if cur else 0) is not None:
                self._next, self._end = start, end
                return

    async def init(self, producer_id: int, epoch: int) -> tuple[int, int]:
        """The (id, epoch) answer to InitProducerId: a fresh id at epoch 0, or the given id bumped."""
        if producer_id >= 0 and 0 <= epoch < MAX_EPOCH - 1:
            return producer_id, epoch + 1
        return await self.allocate(), 0


@dataclass(slots=True)
class BatchRecord:
    first_seq: int
    last_seq: int
    base_offset: int
    offset_count: int
    future: asyncio.Future | None = None  # the entry's acknowledgement, while in flight (live table)


class ProducerEntry:
    __slots__ = ("epoch", "batches")

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.batches: deque[BatchRecord] = deque(maxlen=BATCHES_KEPT)

    @property
    def last_seq(self) -> int:
        return self.batches[-1].last_seq if self.batches else -1


def in_sequence(last_seq: int, first_seq: int) -> bool:
    return first_seq == last_seq + 1 or (first_seq == 0 and last_seq == (1 << 31) - 1)


class ProducerStateTable:
    """Per producer id: epoch and the last 5 batches, for one partition. Least recently written
    producers are forgotten beyond ``max_producers``."""

    def __init__(self, max_producers: int = 10_000, complete: bool = True):
        self.max_producers = max_producers
        self.complete = complete
        self.producers: dict[int, ProducerEntry] = {}

    def check(self, pid: int, epoch: int, first_seq: int, last_seq: int) -> BatchRecord | None:
        """None: append the batch; a BatchRecord: it duplicates that stored (or in-flight) batch.
        Raises InvalidProducerEpoch / OutOfOrderSequenceNumber / UnknownProducerId."""
        entry = self.producers.get(pid)
        if entry is None:
            if first_seq != 0 and self.complete:
                raise UnknownProducerId(f"producer {pid} has no state here and sent sequence {first_seq}")
            return None
        if epoch < entry.epoch:
            raise InvalidProducerEpoch(f"producer {pid}: epoch {epoch} is older than {entry.epoch}")
        if epoch > entry.epoch:
            if first_seq != 0:
                raise OutOfOrderSequenceNumber(f"producer {pid}: new epoch {epoch} starts at sequence {first_seq}, "
                                               "not 0")
            return None
        for b in entry.batches:
            if b.first_seq == first_seq and b.last_seq == last_seq:
                return b
        if not entry.batches or in_sequence(entry.last_seq, first_seq):
            return None
        raise OutOfOrderSequenceNumber(f"producer {pid} epoch {epoch}: sequence {first_seq}..{last_seq} does not "
                                       f"follow {entry.last_seq}")

    def record(self, pid: int, epoch: int, rec: BatchRecord) -> None:
        entry = self.producers.pop(pid, None)  # re-inserted last: dict order is least recently written first
        if entry is None or entry.epoch != epoch:
            entry = ProducerEntry(epoch)
        entry.batches.append(rec)
        self.producers[pid] = entry
        while len(self.producers) > self.max_producers:
            del self.producers[next(iter(self.producers))]

    def fence(self, pid: int, epoch: int) -> None:
        """A transaction marker at ``epoch`` was written: an older epoch is fenced from now on, and a
        newer one starts afresh (its batches must start at sequence 0)."""
        entry = self.producers.get(pid)
        if entry is None or entry.epoch < epoch:
            self.producers.pop(pid, None)
            self.producers[pid] = ProducerEntry(epoch)
            while len(self.producers) > self.max_producers:
                del self.producers[next(iter(self.producers))]

    def copy(self) -> ProducerStateTable:
        t = ProducerStateTable(self.max_producers, self.complete)
        for pid, e in self.producers.items():
            n = ProducerEntry(e.epoch)
            n.batches.extend(BatchRecord(b.first_seq, b.last_seq, b.base_offset, b.offset_count) for b in e.batches)
            t.producers[pid] = n
        return t

    # ---------------------------------------------------------------- snapshots
    def to_json(self) -> dict:
        return {str(pid): [e.epoch, [[b.first_seq, b.last_seq, b.base_offset, b.offset_count] for b in e.batches]]
                for pid, e in self.producers.items()}

    @classmethod
    def from_json(cls, d: dict, max_producers: int = 10_000, complete: bool = True) -> ProducerStateTable:
        t = cls(max_producers, complete)
        for pid, (epoch, batches) in d.items():
            if not batches:  # fenced by a transaction marker, no batch at this epoch yet
                t.fence(int(pid), int(epoch))
            for first, last, base, count in batches:
                t.record(int(pid), int(epoch), BatchRecord(int(first), int(last), int(base), int(count)))
        return t


@dataclass(frozen=True)
class StateSnapshot:
    """The acked producer state of a partition: exact for every batch below record offset
    ``offset`` of stream ``stream_id``, written by the shim that wrote the stream in ``term``."""

    stream_id: int
    offset: int
    term: int
    producers: dict
    txns: dict | None = None  # the partition's transaction index (``transactions.PartitionTxns``)

    def encode(self) -> bytes:
        d = {"stream_id": self.stream_id, "offset": self.offset, "term": self.term, "producers": self.producers}
        if self.txns:
            d["txns"] = self.txns
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> StateSnapshot:
        d = json.loads(raw)
        return cls(int(d["stream_id"]), int(d["offset"]), int(d["term"]), dict(d["producers"]), d.get("txns"))
