"""The data plane's frame splitter (``bookie.wire.FrameReader``) against the one it replaced (issue
26), same run: microseconds per frame for a byte stream of read answers cut into socket-sized
chunks (large frames spanning chunks, medium ones several per chunk, small ones many per chunk).
The reference (``Old``) appended every chunk to a bytearray and copied every frame out of it.

    .venv/bin/python bench/frame_reader.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bookie import wire  # noqa: E402
from bookie.wire import FRAME  # noqa: E402


class Old:
    """The splitter before issue 26's second pass: chunks appended to a bytearray, frames copied out."""

    def __init__(self, max_frame_bytes=wire.MAX_FRAME_BYTES_DEFAULT):
        self.buf = bytearray()
        self.max_frame_bytes = max_frame_bytes

    def feed(self, data):
        buf = self.buf
        buf += data
        out = []
        off = 0
        n = len(buf)
        hs = FRAME.size
        with memoryview(buf) as view:
            while n - off >= hs:
                length, op, rid = FRAME.unpack_from(buf, off)
                end = off + 4 + length
                if end > n:
                    break
                with view[off + hs:end] as part:
                    out.append((op, rid, memoryview(bytes(part))))
                off = end
        if off:
            del buf[:off]
        return out


def stream(body_len: int, frames: int) -> bytes:
    body = b"x" * body_len
    return b"".join(wire.frame_head(wire.READ | wire.ANSWER, i, body_len) + body for i in range(frames))


def main() -> None:
    for body_len, frames, chunk in ((1 << 20, 64, 256 << 10), (64 << 10, 512, 256 << 10), (100, 20000, 64 << 10)):
        data = stream(body_len, frames)
        chunks = [data[i:i + chunk] for i in range(0, len(data), chunk)]
        best: dict[str, float] = {}
        for name, cls in (("old", Old), ("new", wire.FrameReader)) * 2:  # interleaved
            for _ in range(5):
                reader = cls()
                t = time.perf_counter()
                k = 0
                for c in chunks:
                    k += len(reader.feed(c))
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
            assert k == frames
        print(f"frames of {body_len} B in {chunk >> 10} KiB chunks: old {best['old'] / frames * 1e6:.2f} µs/frame, "
              f"new {best['new'] / frames * 1e6:.2f} µs/frame, new/old {best['new'] / best['old']:.2f}")


if __name__ == "__main__":
    main()
