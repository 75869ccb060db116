"""Run one fuzz target: ``python -m tests.fuzz.run TARGET [--seconds S] [--runs N] [--work DIR]``.

With atheris (``pip install atheris``; in the ``test`` extra) the run is coverage-guided: libFuzzer
mutates the committed seed corpus (``tests/fuzz/corpus/TARGET``, never written to: new inputs go
to ``DIR/corpus``), with a per-input timeout (a hang is a crash) and an RSS limit (memory must
stay bounded). A crash or hang leaves its input as ``DIR/crash-*`` / ``timeout-*`` / ``oom-*``
and exits non-zero: turn it into a regression test (``tests/fuzz/regressions/TARGET/``). Without
atheris (``--plain``, or it is not installed) a simple mutator replays and mutates the seeds
instead: no coverage feedback, same contract checks.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
SEEDS_OF = {"kafka_dispatch": "kafka_decode"}  # targets that share another one's seeds


def _plain(one, seeds: list[bytes], seconds: float, runs: int, work: Path) -> int:
    rnd = random.Random(int(os.environ.get("SCROLL_FUZZ_SEED", "0")) or None)
    pool = list(seeds) or [b""]
    deadline = time.monotonic() + seconds
    done = 0
    while (runs <= 0 or done < runs) and time.monotonic() < deadline:
        data = bytearray(rnd.choice(pool))
        for _ in range(rnd.randint(1, 8)):
            r = rnd.random()
            if r < 0.4 and data:
                data[rnd.randrange(len(data))] = rnd.getrandbits(8)
            elif r < 0.6:
                data[rnd.randrange(len(data) + 1):0] = rnd.randbytes(rnd.randint(1, 8))
            elif r < 0.75 and data:
                i = rnd.randrange(len(data))
                del data[i:i + rnd.randint(1, 8)]
            elif data:  # an interesting integer at a random place
                i = rnd.randrange(len(data))
                val = rnd.choice([0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000000])
                data[i:i + 4] = val.to_bytes(4, rnd.choice(["big", "little"]))
        data = bytes(data)
        try:
            one(data)
        except Exception:
            path = work / f"crash-{done}"
            path.write_bytes(data)
            print(f"crash: input written to {path}", file=sys.stderr)
            raise
        done += 1
        if len(pool) < 5000 and rnd.random() < 0.01:
            pool.append(data)
    print(f"plain fuzzing: {done} inputs in {seconds - max(0.0, deadline - time.monotonic()):.0f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--runs", type=int, default=0, help="stop after this many inputs (0: only the time bounds)")
    p.add_argument("--work", type=Path, default=None, help="new corpus entries and crash artifacts go here")
    p.add_argument("--timeout", type=int, default=10, help="seconds one input may take (libFuzzer -timeout)")
    p.add_argument("--rss-mb", type=int, default=1536, help="libFuzzer -rss_limit_mb")
    p.add_argument("--plain", action="store_true", help="the plain mutator even if atheris is installed")
    args = p.parse_args(argv)

    from . import targets

    setup, one, instrument = targets.TARGETS[args.target]
    work = args.work or Path(f"/tmp/scroll-fuzz-{args.target}")
    (work / "corpus").mkdir(parents=True, exist_ok=True)
    seed_dir = CORPUS / SEEDS_OF.get(args.target, args.target)
    try:
        if args.plain:
            raise ImportError
        import atheris
    except ImportError:
        setup()
        seeds = [f.read_bytes() for f in sorted(seed_dir.glob("*"))] + [
            f.read_bytes() for f in sorted((work / "corpus").glob("*"))]
        return _plain(one, seeds, args.seconds, args.runs, work)

    with atheris.instrument_imports(include=list(instrument)):
        setup()
    fuzz_args = [sys.argv[0], str(work / "corpus"), str(seed_dir), f"-max_total_time={int(args.seconds)}",
                 f"-timeout={args.timeout}", f"-rss_limit_mb={args.rss_mb}", f"-artifact_prefix={work}/",
                 "-print_final_stats=1", "-max_len=4096"]
    if args.runs:
        fuzz_args.append(f"-runs={args.runs}")
    atheris.Setup(fuzz_args, one)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
