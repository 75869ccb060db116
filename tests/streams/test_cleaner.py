"""Kafka's compaction rules, one by one, on the sans-IO cleaner (streams/cleaner.py)."""

from __future__ import annotations

import struct

from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from streams.batches import records_of, stored_batch
from streams.cleaner import ATTR_DELETE_HORIZON, HOLE, DirtyScan, Rewriter

DAY = 86_400_000


class E:
    def __init__(self, entry_id, data):
        self.entry_id, self.data = entry_id, data


def batch(base, recs, ts=1_000, pid=-1, epoch=-1, seq=-1, txn=False, control=None, last_delta=None):
    b = DefaultRecordBatchBuilder(2, 0, 1 if txn else 0, pid, epoch, seq, 1 << 20)
    for i, (k, v) in enumerate(recs):
        b.append(i, ts + i, k, v, [])
    buf = bytearray(b.build())
    struct.pack_into(">q", buf, 0, base)
    if last_delta is not None:
        struct.pack_into(">i", buf, 23, last_delta)
    if control is not None:
        attrs = struct.unpack_from(">h", buf, 21)[0] | 0x20
        struct.pack_into(">h", buf, 21, attrs)
    from crc32c import crc32c
    struct.pack_into(">I", buf, 17, crc32c(bytes(buf[21:])))
    return b"\x00" + bytes(buf)


def marker(base, pid, epoch, commit: bool):
    key = struct.pack(">hh", 0, 1 if commit else 0)
    value = struct.pack(">hi", 0, 0)
    return batch(base, [(key, value)], pid=pid, epoch=epoch, txn=True, control=True)


def clean(entries, now=10_000, delete_retention_ms=DAY, scan=None):
    ents = [E(i, d) for i, d in enumerate(entries)]
    if scan is None:
        scan = DirtyScan()
        scan.fragment([b for e in ents if (b := stored_batch(e.entry_id, e.data)) is not None])
    return Rewriter(scan, now, delete_retention_ms).fragment(ents), scan


def records(entries):
    out = []
    for i, d in enumerate(entries):
        b = stored_batch(i, d)
        if b is not None:
            out.extend((r.offset, r.key, r.value) for r in records_of(b))
    return out


def test_the_latest_record_of_each_key_is_kept_at_its_offset_in_order():
    out, _ = clean([batch(0, [(b"a", b"1"), (b"b", b"1")]), batch(2, [(b"a", b"2"), (b"c", b"1")]),
                    batch(4, [(b"b", b"3")])])
    assert records(out.entries) == [(2, b"a", b"2"), (3, b"c", b"1"), (4, b"b", b"3")]
    assert out.entries[0] == HOLE  # both its records were superseded


def test_a_rewritten_batch_keeps_base_offset_last_delta_and_producer_fields():
    out, _ = clean([batch(10, [(b"a", b"1"), (b"b", b"1"), (b"c", b"1")], pid=7, epoch=3, seq=40),
                    batch(13, [(b"a", b"2")], pid=7, epoch=3, seq=43)])
    b = DefaultRecordBatch(bytes(out.entries[0][1:]))
    assert b.validate_crc()
    assert (b.base_offset, b.producer_id, b.producer_epoch, b.base_sequence) == (10, 7, 3, 40)
    assert struct.unpack_from(">i", out.entries[0], 1 + 23)[0] == 2  # last offset delta: the batch still ends at 12
    assert [r.offset for r in b] == [11, 12]


def test_an_emptied_batch_holding_its_producers_last_sequence_stays_empty():
    out, _ = clean([batch(0, [(b"a", b"1")], pid=5, epoch=0, seq=0), batch(1, [(b"a", b"2")], pid=9, epoch=0, seq=0),
                    batch(2, [(b"b", b"1")], pid=5, epoch=1, seq=1), batch(3, [(b"b", b"2")])])
    # pid 5's last batch (offset 2) lost its only record but stays, empty, with its sequence
    b = DefaultRecordBatch(bytes(out.entries[2][1:]))
    assert b.validate_crc()
    assert (b.base_offset, b.producer_id, b.producer_epoch, b.base_sequence, len(list(b))) == (2, 5, 1, 1, 0)
    assert out.entries[0] == HOLE  # not pid 5's last batch: it goes


def test_records_without_a_key_are_removed():
    out, _ = clean([batch(0, [(None, b"x"), (b"a", b"1")])])
    assert records(out.entries) == [(1, b"a", b"1")]


def test_a_tombstone_gets_a_delete_horizon_and_goes_once_it_passed():
    now = 50_000
    out, scan = clean([batch(0, [(b"a", b"1")], ts=1_000), batch(1, [(b"a", None)], ts=2_000)], now=now,
                      delete_retention_ms=5_000)
    b = stored_batch(1, out.entries[1])
    assert b.attributes & ATTR_DELETE_HORIZON
    assert struct.unpack_from(">q", out.entries[1], 1 + 27)[0] == now + 5_000  # base timestamp = horizon (KIP-534)
    assert [(r.key, r.value, r.timestamp_ms) for r in records_of(b)] == [(b"a", None, 2_000)]  # timestamp kept
    # a later pass before the horizon keeps it; after, it is gone
    again, _ = clean(out.entries, now=now + 4_999, scan=scan)
    assert records(again.entries) == [(1, b"a", None)]
    later, _ = clean(out.entries, now=now + 5_000, scan=scan)
    assert records(later.entries) == [] and later.tombstones_dropped == 1


def test_aborted_transactions_go_and_their_marker_goes_after_its_horizon():
    entries = [batch(0, [(b"a", b"1")]),
               batch(1, [(b"a", b"aborted")], pid=3, epoch=0, seq=0, txn=True), marker(2, 3, 0, commit=False),
               batch(3, [(b"b", b"committed")], pid=4, epoch=0, seq=0, txn=True), marker(4, 4, 0, commit=True)]
    out, scan = clean(entries, now=1_000, delete_retention_ms=100)
    assert records(out.entries) == [(0, b"a", b"1"), (3, b"b", b"committed")]  # the aborted write did not win
    assert stored_batch(2, out.entries[2]).attributes & ATTR_DELETE_HORIZON  # marker: no data left, horizon set
    assert stored_batch(4, out.entries[4]).attributes & ATTR_DELETE_HORIZON == 0  # its data survives: kept as is
    later, _ = clean(out.entries, now=1_100, scan=scan)
    assert later.entries[2] == HOLE and later.markers_dropped == 1
    assert stored_batch(4, later.entries[4]) is not None


def test_an_open_transaction_ends_the_cleanable_range_before_it():
    scan = DirtyScan()
    assert scan.fragment([stored_batch(0, batch(0, [(b"a", b"1")]))])
    assert not scan.fragment([stored_batch(1, batch(1, [(b"a", b"2")], pid=3, epoch=0, seq=0, txn=True))])
    assert not scan.fragment([stored_batch(2, batch(2, [(b"b", b"1")]))])
    assert scan.safe_fragments == 1 and scan.offsets == {b"a": 0}  # nothing past the open transaction counts


def test_no_ops_and_holes_stay_and_a_non_batch_is_refused():
    noop = b"\x01" + bytes(8)
    out, _ = clean([noop, HOLE, batch(2, [(b"a", b"1")])])
    assert out.entries == [noop, HOLE, out.entries[2]] and not out.changed
    try:
        clean([b"\x00not a batch at all, but longer than nothing" * 2])
    except Exception as exc:  # noqa: BLE001
        assert "not a Kafka record batch" in str(exc)
    else:
        raise AssertionError("a damaged entry was compacted away")


def test_an_unchanged_batch_is_the_same_bytes():
    data = batch(0, [(b"a", b"1"), (b"b", b"1")])
    out, _ = clean([data])
    assert out.entries[0] is data and not out.changed
