"""Retention policy: which sealed fragments at the front of a stream may go. Pure: no IO.

A stream's policy lives in ``LedgerMeta.retention`` (a dict; the retention job in
``streams/tools/retention.py`` keeps its own bookkeeping there too, under ``deleting``)::

    {"max_age_s": 604800, "max_bytes": 10737418240, "keep_from": 1200, "respect_consumers": true}

Positions here are **record offsets** (``streams/batches.py``), the positions users see: fragment
``i`` holds the records ``first_offset(i) .. first_offset(i + 1) - 1``, so whether a fragment is
wholly below an offset is known from metadata alone. The caller passes fragments whose
``first_offset`` it has filled in where the record did not have it (``Consumer.first_offset_of``);
an offset still unknown keeps the fragment wherever an offset is needed to decide.

How a decision is made (``evaluate``). Fragments are looked at from the front and removed as a
prefix only; the walk stops at the first fragment that must stay, so a stream never has holes.
A fragment can go only if

* it is sealed and is not the last fragment (the open fragment, or a CLOSED ledger's last one, is
  never removed: a writer and the LAC always have somewhere to live);
* at least one of ``max_age_s``, ``max_bytes``, ``keep_from`` is set (no policy: keep everything);
  ``max_age_s`` and ``max_bytes`` count only when the stream's ``cleanup_policy`` (the compaction
  key of ``fragments/compaction.py``) includes ``delete``: a ``compact`` stream keeps its records
  until compaction supersedes them, as Kafka applies retention.ms/bytes to ``delete`` topics only
  (``compact,delete`` applies both; ``keep_from``, DeleteRecords, applies always);
* **some configured limit lets all of its records go** — each limit names the records it keeps:

  - ``keep_from``: records at offsets >= keep_from (a fragment goes once the next fragment's
    first offset is <= keep_from);
  - ``max_bytes``: the newest max_bytes bytes: a fragment goes only if the fragments after it
    (known sizes only, so an unknown size keeps more) hold at least max_bytes. This is Kafka's
    ``retention.bytes`` rule: the stream never shrinks below the limit;
  - ``max_age_s``: records younger than max_age_s: the fragment's last batch (the newest, as
    records are appended in time order) must be at least that old by its max timestamp. The
    timestamps come from the caller (``last_timestamps``); an unknown timestamp keeps the fragment;

  and, as in Kafka (``retention.ms`` and ``retention.bytes``), each configured limit removes on
  its own: a fragment goes when any one of them lets it go ("7 days or 10 GiB, whichever removes
  more"), never past a floor. A fragment that holds no record at all (only take-over no-ops) is
  kept by no limit;
* every floor (the lowest record offset a layer above still needs, e.g. the slowest Kafka consumer
  group's committed offset) is at or above the next fragment's first offset, unless
  ``respect_consumers`` is false.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .compaction import InvalidCompactionPolicy, normalise_cleanup_policy
from .model import Fragment

POLICY_KEYS = ("max_age_s", "max_bytes", "keep_from", "respect_consumers")
DELETING = "deleting"  # the retention job's in-progress mark (see streams/tools/retention.py)


class InvalidPolicy(ValueError):
    """A retention setting that does not parse or is out of range."""


@dataclass(frozen=True, slots=True)
class Policy:
    max_age_s: float | None = None
    max_bytes: int | None = None
    keep_from: int | None = None
    respect_consumers: bool = True
    # whether max_age_s / max_bytes apply: the stream's cleanup_policy includes "delete" (read from
    # the compaction key by from_dict; not written by to_dict, the compaction policy owns the key)
    delete: bool = True

    def __post_init__(self) -> None:
        if self.max_age_s is not None and (not isinstance(self.max_age_s, (int, float))
                                           or isinstance(self.max_age_s, bool)
                                           or not math.isfinite(self.max_age_s) or self.max_age_s < 0):
            raise InvalidPolicy(f"max_age_s must be a finite number >= 0, got {self.max_age_s!r}")
        for name in ("max_bytes", "keep_from"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise InvalidPolicy(f"{name} must be an integer >= 0, got {v!r}")
        if not isinstance(self.respect_consumers, bool):
            raise InvalidPolicy(f"respect_consumers must be true or false, got {self.respect_consumers!r}")

    @classmethod
    def from_dict(cls, d: Mapping | None) -> Policy:
        d = d or {}
        try:
            cleanup = normalise_cleanup_policy(d.get("cleanup_policy", "delete"))
        except InvalidCompactionPolicy as exc:
            raise InvalidPolicy(str(exc)) from None
        return cls(
            max_age_s=d.get("max_age_s"), max_bytes=d.get("max_bytes"), keep_from=d.get("keep_from"),
            respect_consumers=d.get("respect_consumers", True), delete="delete" in cleanup.split(","),
        )

    def to_dict(self) -> dict:
        out: dict = {}
        for k in ("max_age_s", "max_bytes", "keep_from"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        out["respect_consumers"] = self.respect_consumers
        return out

    @property
    def age_s(self) -> float | None:
        """``max_age_s`` if it applies (cleanup_policy includes delete)."""
        return self.max_age_s if self.delete else None

    @property
    def size(self) -> int | None:
        """``max_bytes`` if it applies (cleanup_policy includes delete)."""
        return self.max_bytes if self.delete else None

    @property
    def active(self) -> bool:
        """Whether any policy can remove something."""
        return self.age_s is not None or self.size is not None or self.keep_from is not None

    @property
    def inactive_reason(self) -> str:
        """Why nothing can be removed (when not ``active``)."""
        if not self.delete and (self.max_age_s is not None or self.max_bytes is not None):
            return "cleanup_policy compact: max_age_s/max_bytes apply to delete streams only"
        return "no retention policy"


@dataclass(frozen=True, slots=True)
class Decision:
    remove: tuple[Fragment, ...]  # a prefix of the fragments given, front first
    kept_because: str  # why the walk stopped (what protects the first kept fragment)
    keep_first: Fragment | None = None  # the first fragment that stays
    floors: tuple[int, ...] = field(default=())

    @property
    def entries(self) -> int:
        """Entries removed (a protocol fact: no-ops count, records do not)."""
        return sum(f.last_entry_id - f.first_entry_id + 1 for f in self.remove)

    @property
    def records(self) -> int | None:
        """Record offsets removed (None when an offset is unknown)."""
        if not self.remove:
            return 0
        if self.keep_first is None or self.keep_first.first_offset is None or self.remove[0].first_offset is None:
            return None
        return self.keep_first.first_offset - self.remove[0].first_offset

    @property
    def bytes(self) -> int:
        """Bytes removed (fragments of unknown size count 0)."""
        return sum(f.size_bytes or 0 for f in self.remove)

    @property
    def new_first_index(self) -> int | None:
        return self.keep_first.index if self.keep_first is not None else None

    @property
    def new_earliest(self) -> int | None:
        """The first record offset readable once the removal is done (None: not known)."""
        return self.keep_first.first_offset if self.keep_first is not None else None

    @property
    def new_earliest_entry(self) -> int | None:
        """The first entry id kept: bookies drop the entries below it."""
        return self.keep_first.first_entry_id if self.keep_first is not None else None


def evaluate(
    policy: Policy,
    fragments: Sequence[Fragment],
    now_ms: int,
    floors: Iterable[int | None] = (),
    last_timestamps: Mapping[int, int | None] | None = None,
) -> Decision:
    """Which front fragments go now. ``fragments``: the stream's visible fragments by index, with
    their ``first_offset`` (None: unknown); ``floors``: record offsets layers above still need
    (None: no constraint); ``last_timestamps``: fragment index -> max timestamp (ms) of its last
    batch, for ``max_age_s``."""
    frags = sorted(fragments, key=lambda f: f.index)
    fl = tuple(sorted(x for x in floors if x is not None)) if policy.respect_consumers else ()
    stamps = last_timestamps or {}
    # bytes held by each fragment's successors, for max_bytes
    after = [0] * len(frags)
    total = 0
    for i in range(len(frags) - 1, -1, -1):
        after[i] = total
        total += frags[i].size_bytes or 0
    remove: list[Fragment] = []
    reason = "nothing to remove"
    for i, f in enumerate(frags):
        nxt = frags[i + 1] if i + 1 < len(frags) else None
        reason = _keeps(policy, f, nxt, after[i], now_ms, fl, stamps)
        if reason is not None:
            return Decision(tuple(remove), reason, f, fl)
        remove.append(f)
    return Decision(tuple(remove), reason, None, fl)  # only reachable with no fragments


def _keeps(policy: Policy, f: Fragment, nxt: Fragment | None, bytes_after: int, now_ms: int,
           floors: tuple[int, ...], stamps: Mapping[int, int | None]) -> str | None:
    """Why fragment ``f`` (followed by ``nxt``) must stay (None: it may go)."""
    if nxt is None:
        return "last fragment"
    if not f.sealed:
        return "open fragment"
    if not policy.active:
        return policy.inactive_reason
    end = nxt.first_offset  # one past f's last record offset
    if end is not None and f.first_offset is not None and end <= f.first_offset:
        return _floor_reason(end, floors)  # no record in it: no limit keeps anything
    held: list[str] = []  # what each configured limit says; any one limit that lets go removes
    if policy.keep_from is not None:
        if end is not None and end <= policy.keep_from:
            return _floor_reason(end, floors)
        held.append(f"keep_from {policy.keep_from}" + (": offsets unknown" if end is None else ""))
    if policy.size is not None:
        if bytes_after >= policy.size:
            return _floor_reason(end, floors)
        held.append(f"max_bytes {policy.size}")
    if policy.age_s is not None:
        ts = stamps.get(f.index)
        if ts is not None and ts <= now_ms - policy.age_s * 1000:
            return _floor_reason(end, floors)
        held.append("max_age_s: age unknown" if ts is None else f"max_age_s {policy.age_s:g}")
    return "; ".join(held)


def _floor_reason(end: int | None, floors: tuple[int, ...]) -> str | None:
    """Why the floors keep a fragment whose records end below offset ``end`` (None: they do not)."""
    if floors and end is None:
        return f"consumer floor {floors[0]}: offsets unknown"
    for floor in floors:
        if end > floor:
            return f"consumer floor {floor}"
    return None


# ------------------------------------------------------------------------------------ parsing
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_DURATION_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _SIZE_MULT[_p] = _SIZE_MULT[_p + "b"] = 1000 ** _i
    _SIZE_MULT[_p + "i"] = _SIZE_MULT[_p + "ib"] = 1024 ** _i


def parse_duration(text: str) -> float:
    """'90' / '90s' / '15m' / '12h' / '7d' / '2w' / '500ms' -> seconds."""
    m = _DURATION.match(str(text))
    if not m:
        raise InvalidPolicy(f"not a duration: {text!r} (e.g. 90s, 15m, 12h, 7d)")
    return float(m.group(1)) * _DURATION_S[m.group(2)]


def parse_size(text: str) -> int:
    """'1024' / '10GiB' / '500MB' / '64k' -> bytes (KiB/MiB/GiB are powers of 1024, kB/MB/GB of 1000)."""
    m = _SIZE.match(str(text))
    if not m:
        raise InvalidPolicy(f"not a size: {text!r} (e.g. 500MB, 10GiB)")
    return int(float(m.group(1)) * _SIZE_MULT[(m.group(2) or "").lower()])
