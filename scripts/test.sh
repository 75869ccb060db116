#!/usr/bin/env bash
# Runs the test suite. pytest's exit 5 (no tests collected) counts as failure.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check . || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "no tests ran: failing"; exit 1; fi
exit $rc
