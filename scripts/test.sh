#!/usr/bin/env bash
# Runs the test suite. pytest's exit 5 (no tests collected) counts as failure.
#
# With no arguments the Spark tests run in a pytest process of their own: pyspark starts its JVM
# gateway with a preexec_fn, which runs Python in the forked child, and a process that already
# holds gRPC and librdkafka threads (every other test here) can crash in that child (seen once in
# CI: a segfault in threading._after_fork). With arguments, one pytest run as asked.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check . || exit 1
run() {
  .venv/bin/python -m pytest -q --durations=20 "$@"
  local rc=$?
  if [ $rc -eq 5 ]; then echo "no tests ran: failing"; return 1; fi
  return $rc
}
if [ $# -gt 0 ]; then
  run "$@"
  exit $?
fi
run --ignore=tests/spark
rc1=$?
run tests/spark
rc2=$?
[ $rc1 -eq 0 ] && [ $rc2 -eq 0 ]
