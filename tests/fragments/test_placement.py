"""Rack-aware ensemble placement: ensembles span as many racks as the live bookies allow."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from fragments.placement import BookieInfo, NotEnoughBookies, Placement


def cluster(racks: dict[str, int]) -> list[BookieInfo]:
    return [BookieInfo(f"{rack}-b{i}", rack) for rack, n in racks.items() for i in range(n)]


def test_five_bookies_in_three_racks_every_ensemble_spans_three_racks():
    bookies = cluster({"/r1": 2, "/r2": 2, "/r3": 1})
    p = Placement(random.Random(1), bookies)
    rack = {b.bookie_id: b.rack for b in bookies}
    used = Counter()
    for _ in range(300):
        ens = p.choose(3)
        assert len({rack[b] for b in ens}) == 3, ens
        used.update(ens)
    # the lone bookie of /r3 is in every ensemble; the others share their racks' places evenly
    assert used["/r3-b0"] == 300
    assert max(used[b] for b in rack if b != "/r3-b0") - min(used[b] for b in rack if b != "/r3-b0") <= 2


def test_a_replacement_goes_to_a_rack_the_kept_members_do_not_use():
    bookies = cluster({"/r1": 2, "/r2": 2, "/r3": 2})
    p = Placement(random.Random(2), bookies)
    for _ in range(50):
        ens = p.choose(3, exclude={"/r3-b0"}, keep={0: "/r1-b0", 1: "/r2-b1"})
        assert ens[:2] == ("/r1-b0", "/r2-b1")
        assert ens[2] == "/r3-b1"


def test_with_a_rack_down_placement_doubles_up_racks_rather_than_fail():
    bookies = cluster({"/r1": 2, "/r2": 2, "/r3": 1})
    p = Placement(random.Random(3), bookies)
    ens = p.choose(3, exclude={"/r3-b0"})
    assert sorted(b.split("-")[0] for b in ens) in (["/r1", "/r1", "/r2"], ["/r1", "/r2", "/r2"])
    try:
        p.choose(5, exclude={"/r3-b0"})
    except NotEnoughBookies as e:
        assert "need 5 more bookies, only 4 available" in str(e)
    else:
        raise AssertionError("five members from four bookies")


@settings(max_examples=200, deadline=None)
@given(
    racks=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    size=st.integers(1, 5),
    down=st.sets(st.integers(0, 19), max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_an_ensemble_spans_as_many_racks_as_the_live_bookies_allow(racks, size, down, seed):
    bookies = cluster({f"/r{i}": n for i, n in enumerate(racks)})
    excluded = {bookies[i].bookie_id for i in down if i < len(bookies)}
    live = [b for b in bookies if b.bookie_id not in excluded]
    p = Placement(random.Random(seed), bookies)
    if len(live) < size:
        return
    ens = p.choose(size, exclude=excluded)
    assert len(set(ens)) == size and not set(ens) & excluded
    live_per_rack = Counter(b.rack for b in live)
    got = Counter(b.rsplit("-", 1)[0] for b in ens)
    # as even as possible: no rack holds two more than another rack that still had a free bookie
    for n in got.values():
        for other, free in live_per_rack.items():
            if got.get(other, 0) < free:
                assert n <= got.get(other, 0) + 1, (ens, live_per_rack)
    assert len(got) == min(size, len(live_per_rack))
