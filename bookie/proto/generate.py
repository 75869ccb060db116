"""Regenerate ``bookie_pb2.py`` and ``bookie_pb2_grpc.py`` from ``bookie.proto``.

Run as ``python -m bookie.proto.generate`` (or ``make proto``). ``generate(out_dir)`` writes the
files elsewhere, which is how the sync test compares a fresh generation with the checked-in files.
The proto path is given relative to the repository root so that the generated grpc module imports
``bookie.proto.bookie_pb2`` as a package module.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = "bookie/proto/bookie.proto"
GENERATED = ("bookie_pb2.py", "bookie_pb2_grpc.py")


def generate(out_root: Path = ROOT) -> list[Path]:
    """Run protoc; outputs land in ``out_root/bookie/proto/``. Returns the generated paths."""
    from grpc_tools import protoc

    out_root = Path(out_root)
    (out_root / "bookie" / "proto").mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_root}", f"--grpc_python_out={out_root}", PROTO]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return [out_root / "bookie" / "proto" / name for name in GENERATED]


def main() -> int:
    for path in generate():
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
