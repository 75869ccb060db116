#!/usr/bin/env bash
# The cluster test's topology, by hand: hosts are network namespaces on a private subnet.
#   sudo scripts/cluster.sh up [--spark-workers 0] [--dir cluster-data]   # foreground; Ctrl-C tears down
#   sudo scripts/cluster.sh shell c1      # a shell on the client host (another terminal)
#   sudo scripts/cluster.sh status        # hosts, addresses, processes, logs
#   sudo scripts/cluster.sh down          # remove leftovers of a run that was killed
# Needs root, iproute2 and what 'make setup' installs (etcd, the venv, a JDK for Spark).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python -m tests.cluster.topology "$@"
