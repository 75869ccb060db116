"""Tiered storage policy and state: which sealed fragments go to the object store, and when their
bookie copies may go. Pure: no IO.

A stream's tier policy lives in ``LedgerMeta.retention`` beside the retention and compaction
policies, under Kafka's KIP-405 names (same units)::

    {"remote_storage_enable": true,   # offload sealed fragments (Kafka remote.storage.enable)
     "local_retention_ms": -2,        # keep offloaded fragments on bookies this long (-2: as long as
                                      #   retention.ms, i.e. until deleted; -1: forever; 0: release at once)
     "local_retention_bytes": -2,     # keep the newest this many bytes on bookies (-2: retention.bytes; -1: no limit)
     "offload_lag_ms": 0}             # offload a sealed fragment once its newest record is this old

Each fragment record carries its own tier state (``Fragment.tier``), moved one step at a time by
compare-and-set on that record (``streams/tools/tier.py``)::

    None                                             on bookies only
    {"state": "uploading", "key", "uid", "started_ms"}  an upload may be under way: the object, if
                                                     any, is named by key; nothing reads it
    {"state": "offloaded", "key", "size", "crc", ..., "local": true}
                                                     the object is verified; bookies still hold copies
    {"state": "offloaded", ..., "local": false}      bookie copies released: readers use the object

Object keys are ``<prefix>/<ledger id>/<fragment index>.<attempt uid>.seg``: ledger ids are never
reused, so a stream's folder is its purge unit and every object's owner is decidable from its name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .compaction import normalise_cleanup_policy
from .model import Fragment
from .retention import Policy as RetentionPolicy
from .retention import evaluate

POLICY_KEYS = ("remote_storage_enable", "local_retention_ms", "local_retention_bytes", "offload_lag_ms")
UPLOADING = "uploading"
OFFLOADED = "offloaded"
TIER_JOB = "tier"  # the offload job's own state in LedgerMeta.retention (its claim)
USE_TOTAL = -2  # Kafka: local.retention.* = -2 means "the same as retention.*"
UNLIMITED = -1


class InvalidTierPolicy(ValueError):
    """A tier setting out of range, of the wrong type, or not allowed with the stream's others."""


@dataclass(frozen=True, slots=True)
class TierPolicy:
    remote_storage_enable: bool = False
    local_retention_ms: int = USE_TOTAL
    local_retention_bytes: int = USE_TOTAL
    offload_lag_ms: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.remote_storage_enable, bool):
            raise InvalidTierPolicy(f"remote_storage_enable must be true or false, got {self.remote_storage_enable!r}")
        for name in ("local_retention_ms", "local_retention_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < USE_TOTAL:
                raise InvalidTierPolicy(f"{name} must be an integer >= -2 (-2: as retention, -1: no limit), got {v!r}")
        v = self.offload_lag_ms
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InvalidTierPolicy(f"offload_lag_ms must be an integer >= 0, got {v!r}")

    @classmethod
    def from_dict(cls, d: Mapping | None) -> TierPolicy:
        d = d or {}
        return cls(remote_storage_enable=d.get("remote_storage_enable", False),
                   local_retention_ms=d.get("local_retention_ms", USE_TOTAL),
                   local_retention_bytes=d.get("local_retention_bytes", USE_TOTAL),
                   offload_lag_ms=d.get("offload_lag_ms", 0))

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in POLICY_KEYS}

    def local_limits(self, total: RetentionPolicy) -> tuple[float | None, int | None]:
        """(seconds, bytes) an offloaded fragment stays on bookies; None: no limit of that kind.
        -2 takes the total retention's limit (which deletes the fragment anyway: Kafka's default)."""
        ms = self.local_retention_ms
        age = (total.age_s if ms == USE_TOTAL else None if ms == UNLIMITED else ms / 1000)
        b = self.local_retention_bytes
        size = (total.size if b == USE_TOTAL else None if b == UNLIMITED else b)
        return age, size


def validate(retention: Mapping) -> None:
    """Refuse combinations Kafka refuses (3.9 ``LogConfig.validate``, when remote storage is on):
    remote storage on a compacted topic, and a local limit above the total one (KIP-405:
    local.retention.ms <= retention.ms, same for bytes; with a total limit set, a local -1, no
    limit, is above it too). -2 (as the total) is always allowed."""
    tp = TierPolicy.from_dict(retention)
    if not tp.remote_storage_enable:
        return
    if "compact" in normalise_cleanup_policy(retention.get("cleanup_policy", "delete")).split(","):
        raise InvalidTierPolicy("Remote log storage is unsupported for the compacted topics")
    total = RetentionPolicy.from_dict(retention)
    total_ms = None if total.max_age_s is None else int(total.max_age_s * 1000)
    for name, local, limit, kafka in (("ms", tp.local_retention_ms, total_ms, "retention.ms"),
                                      ("bytes", tp.local_retention_bytes, total.max_bytes, "retention.bytes")):
        if limit is None or local == USE_TOTAL:
            continue
        if local == UNLIMITED:
            raise InvalidTierPolicy(f"local.retention.{name} must not be -1 (no limit) as {kafka} is set "
                                    f"({limit}): use -2 (as {kafka}) or a value <= {limit}")
        if local > limit:
            raise InvalidTierPolicy(f"local.retention.{name} ({local}) must not be more than {kafka} ({limit})")


def validate_change(old: Mapping | None, new: Mapping) -> None:
    """Refuse turning remote storage off once it is on (Kafka 3.9 refuses it without
    remote.log.delete.on.disable, which is not offered here), then ``validate(new)``."""
    if TierPolicy.from_dict(old).remote_storage_enable and not TierPolicy.from_dict(new).remote_storage_enable:
        raise InvalidTierPolicy("disabling remote storage is not supported: delete the topic, or keep it enabled "
                                "with local.retention.* = -2 (bookies keep what retention keeps)")
    validate(new)


# ------------------------------------------------------------------------------- fragment state
def state(f: Fragment) -> str | None:
    return (f.tier or {}).get("state")


def offloaded(f: Fragment) -> bool:
    return state(f) == OFFLOADED


def local(f: Fragment) -> bool:
    """Whether bookies hold the fragment's entries (everything but a released offloaded fragment)."""
    return not (offloaded(f) and f.tier.get("local") is False)


def remote_only(f: Fragment) -> bool:
    return offloaded(f) and f.tier.get("local") is False


def object_name(ledger_id: int, index: int, uid: str) -> str:
    """The key below the tier's prefix of fragment ``index``'s object, upload attempt ``uid``."""
    return f"{ledger_id}/{index:012d}.{uid}.seg"


_NAME = re.compile(r"(?:^|/)(\d+)/(\d+)\.([0-9a-z]+)\.seg$")


def parse_object_name(key: str) -> tuple[int, int, str] | None:
    """(ledger id, fragment index, uid) of an object key (with or without the prefix), or None."""
    m = _NAME.search(key)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


# ----------------------------------------------------------------------------------- decisions
def to_offload(fragments: Sequence[Fragment], policy: TierPolicy, now_ms: int,
               last_timestamps: Mapping[int, int | None] | None = None) -> list[Fragment]:
    """The sealed fragments to upload now, front first, in order: every sealed fragment that is not
    offloaded yet, up to the first one that may not go yet (open, or younger than offload_lag_ms by
    its newest record; an unknown timestamp counts as too young when a lag is set). A fragment
    being uploaded by an earlier attempt is included: the job resumes or redoes it."""
    if not policy.remote_storage_enable:
        return []
    out = []
    stamps = last_timestamps or {}
    for f in sorted(fragments, key=lambda x: x.index):
        if offloaded(f):
            continue
        if not f.sealed:
            break
        if policy.offload_lag_ms:
            ts = stamps.get(f.index)
            if ts is None or ts > now_ms - policy.offload_lag_ms:
                break
        out.append(f)
    return out


def to_release(fragments: Sequence[Fragment], policy: TierPolicy, total: RetentionPolicy, now_ms: int,
               last_timestamps: Mapping[int, int | None] | None = None) -> list[Fragment]:
    """The offloaded fragments whose bookie copies may go now, front first: the local policy
    (Kafka's local.retention.ms/bytes, by the same rules retention applies to the whole stream)
    lets them go, and every fragment before them is released or going too. Never the last
    fragment, never one that is not verified offloaded."""
    if not policy.remote_storage_enable:
        return []
    age_s, size = policy.local_limits(total)
    if age_s is None and size is None:
        return []
    local_policy = RetentionPolicy(max_age_s=age_s, max_bytes=size, respect_consumers=False)
    decision = evaluate(local_policy, fragments, now_ms, (), last_timestamps)
    out = []
    for f in decision.remove:
        if not offloaded(f):
            break
        if local(f):
            out.append(f)
    return out


TIER_CONFIG_KEY = "/scroll/tier/config"  # the cluster's object store: TierConfig.to_dict() as JSON (no secrets)
