"""Incremental fetch sessions (KIP-227). Sans-IO: the broker passes the clock in.

How this works. A consumer of many partitions asks for a session with a full fetch at epoch 0
(session id 0, or the id of a session it closes). The listener remembers the partitions of that
request (fetch offset, byte limit) under a new session id and answers it in the response. From
then on the consumer sends incremental fetches, (session id, epoch 1, 2, ...), naming only the
partitions whose fetch offset or limit changed since its last request and, under "forgotten", the
ones it no longer wants; the listener reads every partition of the session and answers only the
partitions that have something to say: records, an error, or a high watermark, last stable offset
or log start different from the one it last sent in that session. So an idle consumer of 100
partitions sends and receives almost nothing.

The rules are Kafka's (``FetchSession`` / ``FetchSessionHandler``):

- epoch -1 (final): a sessionless full fetch; a session named by the id is closed. Answer id 0.
- epoch 0 (initial): a full fetch that opens a new session (closing the named one). When the cache
  is full and no session is old enough to evict, the fetch is served without a session (id 0).
- epoch > 0: the named session must exist (else FETCH_SESSION_ID_NOT_FOUND) and expect exactly this
  epoch (else INVALID_FETCH_SESSION_EPOCH); both errors answer no partitions, and the client then
  starts a new session. A session's epoch goes up by one per request (wrapping to 1 after 2**31-1).
- A full response names every requested partition; an incremental one only the changed ones.

Sessions are kept per listener (any connection may use one, as in Kafka), at most
``max_sessions``; one unused for ``idle_s`` may be evicted for a new one, the least recently used
first.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

INITIAL_EPOCH = 0
FINAL_EPOCH = -1
MAX_EPOCH = 2**31 - 1

TopicPartition = tuple[str, int]


@dataclass(slots=True)
class CachedPartition:
    fetch_offset: int
    max_bytes: int
    high_watermark: int = -2  # as last answered in this session (-2: never answered)
    last_stable: int = -2
    log_start: int = -2


@dataclass
class FetchSession:
    id: int
    epoch: int  # the epoch the next request must carry
    partitions: dict[TopicPartition, CachedPartition] = field(default_factory=dict)
    last_used: float = 0.0

    def must_answer(self, tp: TopicPartition, has_records: bool, error: bool, hw: int, lso: int, start: int) -> bool:
        """Whether an incremental response includes ``tp``; remembers what it answers."""
        c = self.partitions.get(tp)
        if c is None:
            return True
        changed = (hw, lso, start) != (c.high_watermark, c.last_stable, c.log_start)
        if error or has_records or changed:
            if not error:
                c.high_watermark, c.last_stable, c.log_start = hw, lso, start
            return True
        return False


class SessionError(Exception):
    """The fetch names a session that is gone, or the wrong epoch: ``code`` is the Kafka error."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


FETCH_SESSION_ID_NOT_FOUND = 70
INVALID_FETCH_SESSION_EPOCH = 71


def _next_epoch(epoch: int) -> int:
    return 1 if epoch >= MAX_EPOCH else epoch + 1


class FetchSessionCache:
    def __init__(self, max_sessions: int = 1000, idle_s: float = 120.0, rng: random.Random | None = None):
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._sessions: OrderedDict[int, FetchSession] = OrderedDict()  # least recently used first
        self._rng = rng or random.Random()

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: int) -> FetchSession | None:
        return self._sessions.get(session_id)

    def begin(self, session_id: int, epoch: int, wanted: list[tuple[TopicPartition, int, int]],
              forgotten: list[TopicPartition], now: float) -> tuple[FetchSession | None, bool]:
        """Apply a fetch request's session fields: (the session to answer within or None for a
        sessionless fetch, whether the fetch is full). ``wanted``: (partition, fetch offset, max
        bytes) as in the request. Raises ``SessionError``."""
        if epoch in (INITIAL_EPOCH, FINAL_EPOCH):
            if session_id:
                self._sessions.pop(session_id, None)
            if epoch == FINAL_EPOCH or self.max_sessions == 0 or not self._make_room(now):
                return None, True
            s = FetchSession(self._new_id(), _next_epoch(INITIAL_EPOCH), last_used=now)
            for tp, offset, max_bytes in wanted:
                s.partitions[tp] = CachedPartition(offset, max_bytes)
            self._sessions[s.id] = s
            return s, True
        s = self._sessions.get(session_id)
        if s is None:
            raise SessionError(FETCH_SESSION_ID_NOT_FOUND, f"fetch session {session_id} not found")
        if epoch != s.epoch:
            raise SessionError(INVALID_FETCH_SESSION_EPOCH,
                               f"fetch session {session_id}: epoch {epoch}, expected {s.epoch}")
        for tp in forgotten:
            s.partitions.pop(tp, None)
        for tp, offset, max_bytes in wanted:
            c = s.partitions.get(tp)
            if c is None:
                s.partitions[tp] = CachedPartition(offset, max_bytes)
            else:
                c.fetch_offset, c.max_bytes = offset, max_bytes
        s.epoch = _next_epoch(epoch)
        s.last_used = now
        self._sessions.move_to_end(s.id)
        return s, False

    def drop(self, session_id: int) -> None:
        """Forget a session (a new one whose first answer was throttled: the client opens another,
        as after Kafka's throttled full answer, session id 0)."""
        self._sessions.pop(session_id, None)

    def _make_room(self, now: float) -> bool:
        if len(self._sessions) < self.max_sessions:
            return True
        oldest_id, oldest = next(iter(self._sessions.items()))
        if now - oldest.last_used < self.idle_s:
            return False
        del self._sessions[oldest_id]
        return True

    def _new_id(self) -> int:
        while True:
            sid = self._rng.randrange(1, 2**31)
            if sid not in self._sessions:
                return sid
