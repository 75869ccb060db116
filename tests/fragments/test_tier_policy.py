"""The pure tier policy (fragments/tier.py): the policy record, Kafka's cross-checks, and which
fragments go to the object store and when their bookie copies may go."""

from __future__ import annotations

import dataclasses

import pytest

from fragments.model import Fragment
from fragments.retention import Policy
from fragments.tier import (
    InvalidTierPolicy,
    TierPolicy,
    object_name,
    parse_object_name,
    to_offload,
    to_release,
    validate,
    validate_change,
)

NOW = 100_000_000
MIN = 60_000


def chain(n: int, size: int = 100, entries: int = 10, open_last: bool = True) -> list[Fragment]:
    out = []
    for i in range(n):
        sealed = not (open_last and i == n - 1)
        out.append(Fragment(i, i * entries, ("a", "b", "c"), 1, (i + 1) * entries - 1 if sealed else None,
                            size if sealed else None, first_offset=i * entries))
    return out


def offloaded(f: Fragment, local: bool = True) -> Fragment:
    return dataclasses.replace(f, tier={"state": "offloaded", "key": f"1/{f.index}.x.seg", "size": 1, "crc": 0,
                                        "local": local})


def uploading(f: Fragment) -> Fragment:
    return dataclasses.replace(f, tier={"state": "uploading", "key": f"1/{f.index}.x.seg", "uid": "x",
                                        "started_ms": NOW})


ON = TierPolicy(remote_storage_enable=True)


# ------------------------------------------------------------------------------- the policy record
def test_defaults_and_round_trip():
    assert TierPolicy.from_dict(None) == TierPolicy() == TierPolicy.from_dict({"max_age_s": 5})
    assert TierPolicy().to_dict() == {"remote_storage_enable": False, "local_retention_ms": -2,
                                      "local_retention_bytes": -2, "offload_lag_ms": 0}
    p = TierPolicy(True, 3_600_000, 1 << 30, 600_000)
    assert TierPolicy.from_dict({**p.to_dict(), "cleanup_policy": "delete", "deleting": {}}) == p


@pytest.mark.parametrize("d", [
    {"remote_storage_enable": "true"}, {"remote_storage_enable": 1}, {"local_retention_ms": -3},
    {"local_retention_bytes": -3}, {"local_retention_ms": 1.5}, {"local_retention_bytes": True},
    {"offload_lag_ms": -1}, {"offload_lag_ms": "10m"},
])
def test_out_of_range_or_wrong_type_is_refused(d):
    with pytest.raises(InvalidTierPolicy):
        TierPolicy.from_dict(d)


def test_local_limits():
    total = Policy(max_age_s=7 * 86400, max_bytes=10_000)
    assert TierPolicy().local_limits(total) == (7 * 86400, 10_000)  # -2: retention's
    assert TierPolicy(True, -1, -1).local_limits(total) == (None, None)
    assert TierPolicy(True, 3_600_000, 500).local_limits(total) == (3600, 500)
    assert TierPolicy(True, 0, 0).local_limits(total) == (0, 0)
    # retention by age and size applies to delete streams only: a compact stream's -2 is no limit
    compact = Policy.from_dict({"max_age_s": 60, "max_bytes": 5, "cleanup_policy": "compact"})
    assert TierPolicy().local_limits(compact) == (None, None)


# ------------------------------------------------------------------------------- Kafka's checks
def test_validate_allows_what_kafka_allows():
    validate({})
    validate({"cleanup_policy": "compact"})  # no remote storage: anything goes
    validate({"remote_storage_enable": False, "local_retention_ms": 10**9, "max_age_s": 1})
    validate({"remote_storage_enable": True})
    validate({"remote_storage_enable": True, "max_age_s": 3600, "max_bytes": 100, "local_retention_ms": 3_600_000,
              "local_retention_bytes": 100})
    validate({"remote_storage_enable": True, "max_age_s": 3600, "local_retention_ms": -2,
              "local_retention_bytes": -1})  # no retention.bytes: -1 is fine for bytes
    validate({"remote_storage_enable": True, "local_retention_ms": 5, "local_retention_bytes": 7})


@pytest.mark.parametrize("retention,text", [
    ({"cleanup_policy": "compact"}, "Remote log storage is unsupported for the compacted topics"),
    ({"cleanup_policy": "compact,delete"}, "compacted"),
    ({"max_age_s": 3600, "local_retention_ms": 3_600_001}, "local.retention.ms (3600001) must not be more than "
                                                            "retention.ms (3600000)"),
    ({"max_bytes": 100, "local_retention_bytes": 101}, "local.retention.bytes (101) must not be more than"),
    ({"max_age_s": 3600, "local_retention_ms": -1}, "local.retention.ms must not be -1"),
    ({"max_bytes": 100, "local_retention_bytes": -1}, "local.retention.bytes must not be -1"),
])
def test_validate_refuses(retention, text):
    with pytest.raises(InvalidTierPolicy, match=text.replace("(", r"\(").replace(")", r"\)")):
        validate({"remote_storage_enable": True, **retention})


def test_remote_storage_once_on_stays_on():
    on = {"remote_storage_enable": True}
    validate_change(None, on)
    validate_change(on, {**on, "local_retention_ms": 0})
    validate_change({}, {})
    with pytest.raises(InvalidTierPolicy, match="disabling remote storage is not supported"):
        validate_change(on, {})
    with pytest.raises(InvalidTierPolicy, match="disabling"):
        validate_change(on, {"remote_storage_enable": False})
    with pytest.raises(InvalidTierPolicy, match="compacted"):
        validate_change(on, {**on, "cleanup_policy": "compact"})


def test_object_names_read_back():
    key = "tier/" + object_name(42, 7, "abc123")
    assert parse_object_name(key) == (42, 7, "abc123") and parse_object_name("42/7.seg") is None


# ------------------------------------------------------------------------------- to_offload
def test_offload_nothing_when_off():
    assert to_offload(chain(5), TierPolicy(), NOW) == []


def test_offload_sealed_only_in_order_up_to_the_open_fragment():
    frags = chain(4)
    assert [f.index for f in to_offload(list(reversed(frags)), ON, NOW)] == [0, 1, 2]
    closed = chain(3, open_last=False)  # a closed ledger's last fragment is sealed: it goes too
    assert [f.index for f in to_offload(closed, ON, NOW)] == [0, 1, 2]


def test_offload_skips_offloaded_and_resumes_uploading():
    frags = chain(5)
    frags[0] = offloaded(frags[0], local=False)
    frags[1] = offloaded(frags[1])
    frags[2] = uploading(frags[2])
    assert [f.index for f in to_offload(frags, ON, NOW)] == [2, 3]


def test_offload_lag_stops_at_a_too_young_fragment():
    frags = chain(5)
    lagged = TierPolicy(remote_storage_enable=True, offload_lag_ms=10 * MIN)
    stamps = {0: NOW - 60 * MIN, 1: NOW - 10 * MIN, 2: NOW - 5 * MIN, 3: NOW - 60 * MIN}
    assert [f.index for f in to_offload(frags, lagged, NOW, stamps)] == [0, 1]  # 2 too young: 3 waits too
    assert [f.index for f in to_offload(frags, lagged, NOW, {0: NOW - 60 * MIN})] == [0]  # unknown: too young
    assert [f.index for f in to_offload(frags, ON, NOW, {})] == [0, 1, 2, 3]  # no lag: age not needed


# ------------------------------------------------------------------------------- to_release
def test_release_only_offloaded_local_fragments_as_a_prefix():
    frags = chain(6)
    for i in (0, 1, 3):
        frags[i] = offloaded(frags[i])
    policy = TierPolicy(True, local_retention_ms=0)
    stamps = {i: NOW - 60 * MIN for i in range(6)}
    # 2 is not offloaded: it and everything after it stay on bookies
    assert [f.index for f in to_release(frags, policy, Policy(), NOW, stamps)] == [0, 1]
    frags[0] = offloaded(frags[0], local=False)  # already released: not again, and no stop
    assert [f.index for f in to_release(frags, policy, Policy(), NOW, stamps)] == [1]
    assert to_release(frags, TierPolicy(False, 0, 0), Policy(), NOW, stamps) == []  # tier off


def test_release_never_the_last_fragment():
    frags = [offloaded(f) for f in chain(3, open_last=False)]
    stamps = {i: NOW - 60 * MIN for i in range(3)}
    assert [f.index for f in to_release(frags, TierPolicy(True, 0, 0), Policy(), NOW, stamps)] == [0, 1]


def test_release_by_local_age():
    frags = [offloaded(f) for f in chain(5)]
    stamps = {0: NOW - 90 * MIN, 1: NOW - 70 * MIN, 2: NOW - 30 * MIN, 3: NOW - 90 * MIN}
    policy = TierPolicy(True, local_retention_ms=60 * MIN)
    assert [f.index for f in to_release(frags, policy, Policy(), NOW, stamps)] == [0, 1]  # 2 young: 3 waits
    assert to_release(frags, policy, Policy(), NOW, {}) == []  # age unknown: kept


def test_release_by_local_bytes():
    frags = [offloaded(f) for f in chain(6, size=100)]  # 5 sealed of 100 bytes
    policy = TierPolicy(True, local_retention_bytes=200)
    # keep the newest 200 bytes: 3 and 4 hold them, 0..2 may go
    assert [f.index for f in to_release(frags, policy, Policy(), NOW)] == [0, 1, 2]


def test_release_minus_two_follows_total_retention_minus_one_never():
    frags = [offloaded(f) for f in chain(5)]
    stamps = {i: NOW - 90 * MIN for i in range(5)}
    total = Policy(max_age_s=3600, max_bytes=100)
    assert [f.index for f in to_release(frags, ON, total, NOW, stamps)] == [0, 1, 2, 3]  # -2: as retention.*
    assert to_release(frags, ON, Policy(), NOW, stamps) == []  # -2 with no retention limit: never
    never = TierPolicy(True, -1, -1)
    assert to_release(frags, never, total, NOW, stamps) == []
    # -1 for age, -2 for bytes: the size limit alone
    assert [f.index for f in to_release(frags, TierPolicy(True, -1, -2), Policy(max_bytes=300), NOW)] == [0]
