"""The RocksDB index: entry locations, per-ledger state, entry-log accounting, the checkpoint mark.

How this works. One RocksDB (through rocksdict, raw bytes) holds four kinds of keys:
``E`` + ledger + entry (big-endian, so a ledger's entries sort together and in id order) ->
(log id, offset, record size); ``S`` + ledger -> the ledger's ``LedgerState`` (term, LAC, LAFR,
clean term); ``L`` + log id -> (total bytes, live bytes) of an entry log, which GC uses to pick
logs to compact; ``M`` -> the checkpoint mark (the last journal seq whose effects are all in entry
logs and in this index). A flush writes all four for its generation in one synced ``WriteBatch``:
either the whole checkpoint is durable or none of it is. (One more key, ``C``, holds the scrubber's
position and totals, JSON written by the scrub thread on its own: ``bookie/scrub.py``.) The index is written only by the flush/GC
thread; readers call ``location`` from any thread (RocksDB is thread-safe).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from terms.bookie_rules import LedgerState

ENTRY_KEY = struct.Struct(">cQQ")
_LEDGER_KEY = struct.Struct(">cQ")
_LOG_KEY = struct.Struct(">cI")
LOCATION = struct.Struct("<IQI")  # log id, offset, size
_STATE = struct.Struct("<qqqq")
_LOG_STATS = struct.Struct("<QQ")  # total bytes, live bytes
_MARK = struct.Struct("<Q")
CHECKPOINT_KEY = b"M"
MAX_ENTRY = (1 << 63) - 1


def entry_key(ledger_id: int, entry_id: int) -> bytes:
    return ENTRY_KEY.pack(b"E", ledger_id, entry_id)


def state_key(ledger_id: int) -> bytes:
    return _LEDGER_KEY.pack(b"S", ledger_id)


def log_key(log_id: int) -> bytes:
    return _LOG_KEY.pack(b"L", log_id)


class Index:
    def __init__(self, path: Path) -> None:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_max_background_jobs(2)
        self.path = Path(path)
        self.db = Rdict(str(path), opts)
        self._sync = WriteOptions()
        self._sync.sync = True

    def close(self) -> None:
        self.db.close()

    # --- reads ---------------------------------------------------------------------------

    def location(self, ledger_id: int, entry_id: int) -> tuple[int, int, int] | None:
        raw = self.db.get(entry_key(ledger_id, entry_id))
        return None if raw is None else LOCATION.unpack(raw)

    def entries(self, ledger_id: int, first: int = 0, last: int = MAX_ENTRY) -> Iterator[tuple[int, tuple[int, int, int]]]:
        """(entry id, location) of the ledger's indexed entries with first <= id <= last."""
        it = self.db.iter()
        it.seek(entry_key(ledger_id, first))
        end = entry_key(ledger_id, last)
        while it.valid():
            key = it.key()
            if key > end:
                return
            yield ENTRY_KEY.unpack(key)[2], LOCATION.unpack(it.value())
            it.next()

    def locations_from(self, start: bytes, limit: int) -> tuple[list[tuple[int, int, tuple[int, int, int]]], bytes | None]:
        """Up to ``limit`` (ledger, entry, location) of every ledger, from the entry key ``start``
        (``entry_key``, or b"E" for the first) on; and the key to continue from (None: done). A
        fresh iterator per call, so a long walk (the scrubber) never pins old index files."""
        out = []
        it = self.db.iter()
        it.seek(start)
        while it.valid():
            key = it.key()
            if key[:1] != b"E":
                return out, None
            if len(out) >= limit:
                return out, key
            _kind, lid, eid = ENTRY_KEY.unpack(key)
            out.append((lid, eid, LOCATION.unpack(it.value())))
            it.next()
        return out, None

    def max_entry(self, ledger_id: int) -> int | None:
        it = self.db.iter()
        it.seek_for_prev(entry_key(ledger_id, MAX_ENTRY))
        if not it.valid():
            return None
        key = it.key()
        if len(key) != ENTRY_KEY.size or key[:1] != b"E":
            return None
        _kind, lid, eid = ENTRY_KEY.unpack(key)
        return eid if lid == ledger_id else None

    def load_states(self) -> dict[int, LedgerState]:
        out = {}
        for key, value in self._prefix(b"S"):
            out[_LEDGER_KEY.unpack(key)[1]] = LedgerState(*_STATE.unpack(value))
        return out

    def load_log_stats(self) -> dict[int, list[int]]:
        return {_LOG_KEY.unpack(k)[1]: list(_LOG_STATS.unpack(v)) for k, v in self._prefix(b"L")}

    def checkpoint_seq(self) -> int:
        raw = self.db.get(CHECKPOINT_KEY)
        return 0 if raw is None else _MARK.unpack(raw)[0]

    def _prefix(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        it = self.db.iter()
        it.seek(prefix)
        while it.valid() and it.key()[:1] == prefix:
            yield it.key(), it.value()
            it.next()

    # --- writes (flush/GC thread) ----------------------------------------------------------

    def batch(self) -> WriteBatch:
        return WriteBatch(raw_mode=True)

    @staticmethod
    def put_location(batch: WriteBatch, ledger_id: int, entry_id: int, loc: tuple[int, int, int]) -> None:
        batch.put(entry_key(ledger_id, entry_id), LOCATION.pack(*loc))

    @staticmethod
    def delete_location(batch: WriteBatch, ledger_id: int, entry_id: int) -> None:
        batch.delete(entry_key(ledger_id, entry_id))

    @staticmethod
    def put_state(batch: WriteBatch, ledger_id: int, state: LedgerState | None) -> None:
        if state is None:
            batch.delete(state_key(ledger_id))
        else:
            batch.put(state_key(ledger_id), _STATE.pack(state.term, state.lac, state.lafr, state.clean_term))

    @staticmethod
    def put_log_stats(batch: WriteBatch, log_id: int, stats: list[int] | None) -> None:
        if stats is None:
            batch.delete(log_key(log_id))
        else:
            batch.put(log_key(log_id), _LOG_STATS.pack(*stats))

    @staticmethod
    def put_checkpoint(batch: WriteBatch, seq: int) -> None:
        batch.put(CHECKPOINT_KEY, _MARK.pack(seq))

    def write(self, batch: WriteBatch) -> None:
        """Apply atomically and durably (the checkpoint depends on it)."""
        self.db.write(batch, self._sync)
