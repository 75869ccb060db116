"""The pure retention policy (fragments/retention.py): examples and Hypothesis properties."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fragments.model import Fragment
from fragments.retention import InvalidPolicy, Policy, evaluate, parse_duration, parse_size

NOW = 10_000_000


def chain(sizes: list[int], entries: int = 10, open_last: bool = True, records: list[int] | None = None) -> list[Fragment]:
    """Fragments of ``entries`` entries each; the last one open unless told otherwise. ``records``:
    how many records each holds (default: one per entry), which gives their first offsets."""
    out = []
    offset = 0
    for i, size in enumerate(sizes):
        last = i == len(sizes) - 1
        sealed = not (last and open_last)
        out.append(Fragment(i, i * entries, ("a", "b", "c"), 1, (i + 1) * entries - 1 if sealed else None,
                            size if sealed else None, first_offset=offset))
        offset += entries if records is None else records[i]
    return out


def test_no_policy_removes_nothing():
    d = evaluate(Policy(), chain([100] * 5), NOW)
    assert d.remove == () and d.kept_because == "no retention policy"


def test_keep_from_removes_only_fragments_wholly_below():
    frags = chain([100] * 5)
    d = evaluate(Policy(keep_from=25), frags, NOW)
    assert [f.index for f in d.remove] == [0, 1]  # fragment 2 (20..29) holds 25: it stays
    assert d.new_earliest == 20 and d.new_first_index == 2 and d.entries == 20 and d.bytes == 200
    assert [f.index for f in evaluate(Policy(keep_from=30), frags, NOW).remove] == [0, 1, 2]


def test_keep_from_and_floors_are_record_offsets_not_entry_ids():
    # 10 entries per fragment; fragment 0 holds a take-over no-op and 9 one-record batches, the others
    # 10 batches of 5 records: offsets 0..8 | 9..58 | 59..108 | 109..158 | 159..
    frags = chain([100] * 5, records=[9, 50, 50, 50, 50])
    d = evaluate(Policy(keep_from=60), frags, NOW)
    assert [f.index for f in d.remove] == [0, 1]  # fragment 2 starts at offset 59 and holds 60
    assert d.new_earliest == 59 and d.new_earliest_entry == 20 and d.records == 59 and d.entries == 20
    assert [f.index for f in evaluate(Policy(keep_from=59), frags, NOW).remove] == [0, 1]
    assert [f.index for f in evaluate(Policy(keep_from=58), frags, NOW).remove] == [0]
    d = evaluate(Policy(keep_from=1000), frags, NOW, floors=[109])
    assert [f.index for f in d.remove] == [0, 1, 2] and d.kept_because == "consumer floor 109"


def test_an_unknown_offset_keeps_where_an_offset_decides():
    frags = chain([100] * 5)
    frags[2] = dataclasses.replace(frags[2], first_offset=None)  # fragment 1's end is unknown
    d = evaluate(Policy(keep_from=40), frags, NOW)
    assert [f.index for f in d.remove] == [0] and "offsets unknown" in d.kept_because
    d = evaluate(Policy(max_bytes=100), frags, NOW, floors=[40])
    assert [f.index for f in d.remove] == [0] and "offsets unknown" in d.kept_because
    assert [f.index for f in evaluate(Policy(max_bytes=100), frags, NOW).remove] == [0, 1, 2]  # bytes need none


def test_a_fragment_without_records_is_kept_by_no_limit():
    frags = chain([100] * 4, records=[10, 0, 10, 10])  # fragment 1: no-ops only
    stamps = {0: NOW - 100_000}  # fragment 1's age is unknown (it holds no batch)
    d = evaluate(Policy(max_age_s=10), frags, NOW, last_timestamps=stamps)
    assert [f.index for f in d.remove] == [0, 1] and d.new_earliest == 10
    assert evaluate(Policy(max_age_s=10), frags, NOW, floors=[5], last_timestamps=stamps).remove == ()


def test_never_the_last_fragment_even_if_sealed():
    frags = chain([100] * 3, open_last=False)  # a CLOSED ledger: every fragment sealed
    d = evaluate(Policy(keep_from=10_000), frags, NOW)
    assert [f.index for f in d.remove] == [0, 1] and d.kept_because == "last fragment"
    d = evaluate(Policy(keep_from=10_000), chain([100] * 3), NOW)
    assert [f.index for f in d.remove] == [0, 1]


def test_max_bytes_keeps_at_least_the_limit():
    frags = chain([100, 100, 100, 100, 0])  # the open fragment has no size yet
    assert [f.index for f in evaluate(Policy(max_bytes=200), frags, NOW).remove] == [0, 1]
    assert [f.index for f in evaluate(Policy(max_bytes=201), frags, NOW).remove] == [0]
    assert evaluate(Policy(max_bytes=400), frags, NOW).remove == ()


def test_max_age_uses_last_record_timestamps_and_unknown_keeps():
    frags = chain([100] * 4)
    stamps = {0: NOW - 50_000, 1: NOW - 20_000, 2: NOW - 5_000}
    assert [f.index for f in evaluate(Policy(max_age_s=10), frags, NOW, last_timestamps=stamps).remove] == [0, 1]
    assert [f.index for f in evaluate(Policy(max_age_s=30), frags, NOW, last_timestamps=stamps).remove] == [0]
    d = evaluate(Policy(max_age_s=10), frags, NOW, last_timestamps={0: NOW - 50_000, 1: None})
    assert [f.index for f in d.remove] == [0] and "unknown" in d.kept_because


def test_each_limit_removes_on_its_own_as_in_kafka():
    frags = chain([100] * 6)
    stamps = {i: NOW - 100_000 for i in range(2)}  # fragments 0 and 1 are old, the rest young
    stamps.update({i: NOW for i in range(2, 5)})
    d = evaluate(Policy(max_age_s=10, max_bytes=10_000), frags, NOW, last_timestamps=stamps)
    assert [f.index for f in d.remove] == [0, 1]  # age lets 0..1 go although max_bytes would keep them
    d = evaluate(Policy(max_age_s=10, max_bytes=200), frags, NOW, last_timestamps=stamps)
    assert [f.index for f in d.remove] == [0, 1, 2]  # bytes lets 2 go too (200 sealed bytes follow it)
    d = evaluate(Policy(max_age_s=10, keep_from=45), frags, NOW, last_timestamps=stamps)
    assert [f.index for f in d.remove] == [0, 1, 2, 3]  # keep_from lets 0..3 go
    assert "keep_from 45" in d.kept_because and "max_age_s" in d.kept_because
    d = evaluate(Policy(max_age_s=10, max_bytes=200, keep_from=45), frags, NOW, [15], stamps)
    assert [f.index for f in d.remove] == [0]  # but never past a consumer floor


def test_floors_hold_back_and_can_be_ignored():
    frags = chain([100] * 5)
    d = evaluate(Policy(keep_from=40), frags, NOW, floors=[None, 15])
    assert [f.index for f in d.remove] == [0] and d.kept_because == "consumer floor 15"
    d = evaluate(Policy(keep_from=40, respect_consumers=False), frags, NOW, floors=[15])
    assert [f.index for f in d.remove] == [0, 1, 2, 3]


def test_policy_validation_and_parsing():
    with pytest.raises(InvalidPolicy):
        Policy(max_bytes=-1)
    with pytest.raises(InvalidPolicy):
        Policy.from_dict({"keep_from": "12"})
    with pytest.raises(InvalidPolicy):
        Policy(respect_consumers="yes")
    assert Policy.from_dict(Policy(max_age_s=5.0, keep_from=3).to_dict()) == Policy(max_age_s=5.0, keep_from=3)
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90") == 90 and parse_duration("500ms") == 0.5
    assert parse_size("10GiB") == 10 << 30 and parse_size("500MB") == 500_000_000 and parse_size("64k") == 64_000
    for bad in ("", "7 days", "-1s"):
        with pytest.raises(InvalidPolicy):
            parse_duration(bad)
    with pytest.raises(InvalidPolicy):
        parse_size("ten")


# ------------------------------------------------------------------------------------ properties
@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    lens = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    counts = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))  # records per fragment
    open_last = draw(st.booleans())
    frags, first, offset = [], draw(st.integers(0, 50)), draw(st.integers(0, 50))
    for i in range(n):
        sealed = not (open_last and i == n - 1)
        last = first + lens[i] - 1
        known = draw(st.integers(0, 9)) > 0  # now and then a first offset the record does not have
        frags.append(Fragment(i + 3, first, ("a",), 1, last if sealed else None,
                              draw(st.one_of(st.none(), st.just(sizes[i]))) if sealed else None,
                              first_offset=offset if known else None))
        first = last + 1
        offset += counts[i]
    stamps = {f.index: draw(st.one_of(st.none(), st.integers(NOW - 200_000, NOW))) for f in frags}
    policy = Policy(
        max_age_s=draw(st.one_of(st.none(), st.integers(0, 200))),
        max_bytes=draw(st.one_of(st.none(), st.integers(0, 5000))),
        keep_from=draw(st.one_of(st.none(), st.integers(0, offset + 5))),
        respect_consumers=draw(st.booleans()),
    )
    floors = draw(st.lists(st.one_of(st.none(), st.integers(0, offset + 5)), max_size=3))
    return policy, frags, floors, stamps


@settings(max_examples=250, deadline=None)
@given(scenarios())
def test_removal_is_a_sealed_prefix_that_some_limit_lets_go(scenario):
    policy, frags, floors, stamps = scenario
    d = evaluate(policy, frags, NOW, floors, stamps)
    k = len(d.remove)
    assert list(d.remove) == frags[:k]  # a prefix
    assert k < len(frags)  # never the last fragment
    assert d.keep_first == frags[k]
    if k and not policy.active:
        raise AssertionError("removed without a policy")
    for i, f in enumerate(d.remove):
        assert f.sealed
        end = frags[i + 1].first_offset  # one past its last record offset
        empty = end is not None and f.first_offset is not None and end <= f.first_offset
        lets_go = [
            empty,
            policy.keep_from is not None and end is not None and end <= policy.keep_from,
            policy.max_bytes is not None and sum(g.size_bytes or 0 for g in frags[i + 1:]) >= policy.max_bytes,
            policy.max_age_s is not None and stamps[f.index] is not None
            and stamps[f.index] <= NOW - policy.max_age_s * 1000,
        ]
        assert any(lets_go)  # some configured limit lets it go (Kafka: each limit deletes on its own)
        if policy.respect_consumers and any(fl is not None for fl in floors):
            assert end is not None and all(end <= fl for fl in floors if fl is not None)  # no record a floor needs
    # maximal: the first kept fragment is held by something
    assert d.kept_because


@settings(max_examples=120, deadline=None)
@given(scenarios())
def test_a_stricter_policy_never_removes_more(scenario):
    policy, frags, floors, stamps = scenario
    base = len(evaluate(policy, frags, NOW, floors, stamps).remove)
    stricter = Policy(None if policy.max_age_s is None else policy.max_age_s + 50,
                      None if policy.max_bytes is None else policy.max_bytes + 100,
                      None if policy.keep_from is None else max(0, policy.keep_from - 7), policy.respect_consumers)
    assert len(evaluate(stricter, frags, NOW, floors, stamps).remove) <= base
    first = frags[0].first_offset
    if first is not None:
        more_floors = [*floors, first]  # a floor at the earliest record keeps every fragment holding records
        got = evaluate(policy, frags, NOW, more_floors, stamps)
        assert all(frags[i + 1].first_offset == first for i in range(len(got.remove))) if policy.respect_consumers \
            else len(got.remove) == base
