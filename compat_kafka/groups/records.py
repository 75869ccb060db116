"""What a group keeps in the store beside its offsets: a committed offset (``Committed``) and the
group's kind (``GroupKind``). Apart from the coordinator so that the transaction coordinator (which
commits a transaction's offsets) and the KIP-848 handlers use them without importing it."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Committed:
    offset: int
    leader_epoch: int = -1
    metadata: str = ""
    commit_timestamp_ms: int = 0

    def encode(self) -> bytes:
        return json.dumps({"offset": self.offset, "leader_epoch": self.leader_epoch, "metadata": self.metadata,
                           "commit_timestamp_ms": self.commit_timestamp_ms}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Committed:
        d = json.loads(raw)
        return cls(int(d["offset"]), int(d.get("leader_epoch", -1)), d.get("metadata") or "",
                   int(d.get("commit_timestamp_ms", 0)))


@dataclass(frozen=True)
class GroupKind:
    """What a group is, kept beside its offsets so that an Empty group (no members in memory, or
    after a coordinator move) still lists as Kafka lists it: its type (``classic`` for
    JoinGroup/SyncGroup groups, ``consumer`` for KIP-848 ConsumerGroupHeartbeat groups) and the
    protocol type its members used (``consumer`` for Kafka consumers; empty for groups that only
    ever had offsets committed by ``assign`` consumers, which Kafka calls simple groups)."""

    group_type: str = "classic"
    protocol_type: str = ""

    def encode(self) -> bytes:
        return json.dumps({"group_type": self.group_type, "protocol_type": self.protocol_type}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> GroupKind:
        d = json.loads(raw)
        return cls(str(d["group_type"]), str(d.get("protocol_type") or ""))
