"""The offloaded fragment's object format (streams/tier/segment.py): what goes in comes out, entry
for entry, and every entry, offset and timestamp is found from the index without reading data."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.batches import BatchBuilder, records_of, stored_batch
from streams.tier.segment import FOOTER_BYTES, SegmentBuilder, SegmentFormatError, parse_tail, verify
from terms.entry import KIND_DATA

KIND = bytes([KIND_DATA])


def _entries(plan, first_entry=10, first_offset=100, ts0=1_000):
    """plan: list of record counts; 0 = a no-op entry, -1 = a hole (1-byte data entry)."""
    out, off, ts = [], first_offset, ts0
    for i, n in enumerate(plan):
        eid = first_entry + i
        if n == 0:
            out.append((eid, b""))
        elif n == -1:
            out.append((eid, KIND))
        else:
            b = BatchBuilder(0, 1 << 20)
            for k in range(n):
                assert b.append(b"v%d-%d" % (eid, k) * 20, b"k%d" % k, [], ts)
                ts += 7
            out.append((eid, KIND + bytes(b.build(off))))
            off += n
    return out


def _build(entries, index_every=256):
    sb = SegmentBuilder(entries[0][0], created_term=3, index_every=index_every)
    for eid, data in entries:
        sb.add(eid, data)
    return sb.finish(first_offset_hint=100)


def _read_all(obj, point=-1, last=None):
    idx = parse_tail(obj, len(obj))
    body = memoryview(obj)[(0 if point < 0 else idx.positions[point]):idx.footer.body_len]
    return idx, idx.entries_from(point, body, last)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0, -1, 1, 2, 5, 30]), min_size=1, max_size=40), st.sampled_from([64, 256, 4096]))
def test_entries_round_trip_from_every_index_point(plan, every):
    entries = _entries(plan)
    obj, footer = _build(entries, every)
    assert verify(obj) == footer
    assert footer.size == len(obj)
    idx, (got, used) = _read_all(obj)
    assert used == footer.body_len
    assert [(e, bytes(d)) for e, d in got] == [(e, b"" if stored_batch(e, d) is None else bytes(d)) for e, d in entries]
    for p in range(len(idx.positions)):  # reading from any point gives the same entries from there on
        _, (tail, _) = _read_all(obj, p)
        start = [e for e, _ in got].index(idx.entries[p])
        assert [(e, bytes(d)) for e, d in tail] == [(e, bytes(d)) for e, d in got[start:]]
    # the body alone is a Kafka segment body: batches back to back with their own offsets
    batches = [d[1:] for e, d in entries if stored_batch(e, d) is not None]
    assert obj[:footer.body_len] == b"".join(batches)


def test_offsets_and_timestamps_narrow_to_one_chunk():
    entries = _entries([5] * 50)
    obj, footer = _build(entries, 512)
    idx, (got, _) = _read_all(obj)
    assert footer.first_offset == 100 and footer.end_offset == 350
    recs = [r for e, d in got for r in records_of(stored_batch(e, d))]
    for r in recs[::13]:
        p = idx.point_for_offset(r.offset)
        body = memoryview(obj)[idx.positions[p]:idx.chunk_end(p)]
        found, _ = idx.entries_from(p, body)
        assert any(rr.offset == r.offset for e, d in found for rr in records_of(stored_batch(e, d)))
        p = idx.point_for_timestamp(r.timestamp_ms)
        body = memoryview(obj)[idx.positions[p]:idx.chunk_end(p)]
        found, _ = idx.entries_from(p, body)
        assert any(rr.timestamp_ms >= r.timestamp_ms for e, d in found for rr in records_of(stored_batch(e, d)))
    assert idx.point_for_timestamp(recs[-1].timestamp_ms + 1) is None


def test_a_cut_range_stops_before_a_partial_batch():
    entries = _entries([3] * 10)
    obj, footer = _build(entries)
    idx = parse_tail(obj, len(obj))
    half = memoryview(obj)[:footer.body_len // 2]
    got, used = idx.entries_from(-1, half)
    assert 0 < len(got) < 10 and used <= len(half)
    assert b"".join(bytes(d[1:]) for _, d in got) == bytes(obj[:used])


def test_an_empty_fragment_has_an_object_too():
    obj, footer = _build([(7, b""), (8, b"")])
    assert verify(obj).body_len == 0 and footer.first_offset == footer.end_offset == 100
    idx, (got, _) = _read_all(obj)
    assert got == [(7, b""), (8, b"")]


def test_damage_is_detected():
    obj, footer = _build(_entries([4] * 8))
    for at in (3, footer.body_len + 5, len(obj) - 20, len(obj) - 2):
        bad = bytearray(obj)
        bad[at] ^= 0x40
        with pytest.raises(SegmentFormatError):
            verify(bytes(bad), "k")
    with pytest.raises(SegmentFormatError, match="shorter|bad magic|truncated|says"):
        verify(obj[:-5])
    tail = obj[-FOOTER_BYTES:]
    assert parse_tail(tail, len(obj)) == footer.meta_len + FOOTER_BYTES  # asks for more
