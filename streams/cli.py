"""The ``scroll`` command line."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Scroll: unbounded replicated streams with terms and truncate-on-take-over."""


@main.command()
@click.option("--seeds", default=50, show_default=True, help="How many simulator seeds to run.")
@click.option("--first-seed", default=1, show_default=True)
def demo(seeds: int, first_seed: int) -> None:
    """Run the deterministic cluster simulator and print what it checked."""
    from tests.sim.__main__ import run_cli

    raise SystemExit(run_cli(["--seeds", str(seeds), "--first-seed", str(first_seed)]))


def _register_optional() -> None:
    try:
        from bookie.cli import bookie_command
    except ImportError:  # the bookie package is optional until it is built
        return
    main.add_command(bookie_command, "bookie")


_register_optional()
