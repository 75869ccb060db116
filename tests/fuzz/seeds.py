"""Write the seed corpora of the fuzz targets: ``python -m tests.fuzz.seeds`` (tests/fuzz/corpus/).

Kafka: one valid request frame body per supported (api key, version), in each input mode of the
targets (raw, header + body, patched encoding, stream). Bookie frames: valid ADD, READ, READ_LAC,
WRITE_LAC and AUTH frames. Bookie storage: a few programs (adds that start a ledger, reads).
"""

from __future__ import annotations

import hashlib

from bookie import digest, wire

from . import kafka_seeds
from .run import CORPUS


def _write(target: str, items: dict[str, bytes]) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*"):
        old.unlink()
    for name, data in items.items():
        (d / f"{name}-{hashlib.sha1(data).hexdigest()[:8]}").write_bytes(data)


def main() -> None:
    seeds = kafka_seeds.seeds()
    pairs = kafka_seeds.supported_pairs()
    kafka = {}
    for i, (key, version) in enumerate(pairs):
        body = seeds[f"k{key:02d}v{version:02d}"]
        kafka[f"raw-k{key}v{version}"] = b"\x00" + body
        kafka[f"patch-k{key}v{version}"] = b"\x02" + i.to_bytes(2, "big") + b"\x00"
        if i % 10 == 0:  # a stream of two frames, cut in 7-byte chunks
            kafka[f"stream-k{key}v{version}"] = b"\x03\x06\x00" + (len(body).to_bytes(4, "big") + body) * 2
    _write("kafka_decode", kafka)

    frames = b"".join([
        b"".join(bytes(x) for x in wire.add_frame(1, 1, *reversed(_add(7, 0, b"hello")))),
        wire.encode_read(2, 7, 0, 10, 100, 1 << 20, 0),
        wire.encode_read(3, 7, 0, 10, 100, 1 << 20, -1),
        wire.encode_read_lac(4, 7, -1, 0),
        wire.encode_write_lac(5, 7, 1, 0, 0),
        wire.encode_auth(6, "token"),
    ])
    _write("bookie_frames", {"all-ops": b"\x10" + frames, "one-chunk": b"\x60" + frames[:200]})

    # bookie_storage programs: op, ledger pick, ... (see targets.bookie_storage)
    _write("bookie_storage", {
        "start-ledger": bytes([0, 1, 0, 0, 1, 0, 0, 1, 0, 5]) + b"hello",
        "add-then-read": bytes([0, 2, 1, 1, 1, 0, 0, 0, 0, 3]) + b"abc" + bytes([2, 2, 0, 5, 4, 0]),
        "write-lac": bytes([3, 1, 1, 1, 1]),
    })


def _add(lid: int, eid: int, data: bytes) -> tuple[list, int]:
    return wire.add_entry(lid, eid, 1, -1, -1, True, False, 0, digest.crc32c_digest(lid, eid, data), data)


if __name__ == "__main__":
    main()
