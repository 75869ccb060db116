"""The data plane's frame splitter (``bookie.wire.FrameReader``): every way a byte stream can be
cut into chunks gives the same frames, and a large frame (an add or a read answer of big entries)
is handed on as a view of the bytes it arrived in, not copied twice (issue 26: 27% of a tailed
listener's profile was these copies)."""

import pytest

from bookie import wire


def _stream() -> tuple[bytes, list[tuple[int, int, bytes]]]:
    frames = [(wire.ADD, 1, b"a" * 3), (wire.READ | wire.ANSWER, 2, bytes(range(256)) * 40),
              (wire.ERROR, 3, b""), (wire.WRITE_LAC, 4, b"xyz" * 7)]
    data = b"".join(wire.frame_head(op, rid, len(body)) + body for op, rid, body in frames)
    return data, frames


@pytest.mark.parametrize("step", [1, 2, 3, 7, 9, 100, 4096, 1 << 20])
def test_any_chunking_gives_the_same_frames(step):
    data, want = _stream()
    reader = wire.FrameReader()
    got = []
    for i in range(0, len(data), step):
        got += [(op, rid, bytes(body)) for op, rid, body in reader.feed(data[i:i + step])]
    assert got == want
    assert reader.buffered == 0


def test_incomplete_frame_is_held_and_a_bad_length_refused():
    data, want = _stream()
    reader = wire.FrameReader()
    assert reader.feed(data[:-1]) != []
    assert reader.buffered > 0
    assert [(op, rid, bytes(b)) for op, rid, b in reader.feed(data[-1:])] == want[-1:]
    with pytest.raises(wire.FrameError):
        wire.FrameReader(max_frame_bytes=1024).feed(wire.frame_head(wire.ADD, 1, 4096))


def test_a_large_frame_is_not_copied_again():
    body = bytes(range(256)) * 4096  # 1 MiB: arrives in several chunks
    data = wire.frame_head(wire.READ | wire.ANSWER, 9, len(body)) + body
    reader = wire.FrameReader()
    out = []
    for i in range(0, len(data), 256 * 1024):
        out += reader.feed(data[i:i + 256 * 1024])
    [(op, rid, view)] = out
    assert (op, rid, view) == (wire.READ | wire.ANSWER, 9, body)
    assert len(view.obj) == len(data)  # a view of the chunks joined once: no copy of its own
    whole = wire.FrameReader().feed(data)
    assert whole[0][2].obj is not None and len(whole[0][2].obj) == len(data)


def test_a_small_frame_does_not_pin_its_chunk():
    data, _ = _stream()
    small = wire.FrameReader().feed(data)[0][2]  # 3 bytes out of a ~10 KiB chunk
    assert len(small.obj) == 3
