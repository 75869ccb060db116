"""The checked-in generated gRPC code matches bookie.proto (regenerate: python -m bookie.proto.generate)."""

from __future__ import annotations

from pathlib import Path

from bookie.proto import generate


def test_generated_code_is_in_sync_with_the_proto(tmp_path: Path) -> None:
    fresh = generate.generate(tmp_path)
    for path in fresh:
        checked_in = generate.ROOT / "bookie" / "proto" / path.name
        assert checked_in.read_bytes() == path.read_bytes(), (
            f"{checked_in.name} is stale: run `python -m bookie.proto.generate`"
        )
