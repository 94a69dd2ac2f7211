#!/usr/bin/env bash
# The Grafana dashboard check (run by .ci/run): installs Debian's prometheus package (prometheus
# and promtool) when missing, builds the binary, then runs scripts/grafana-check.py against a live
# `moe-lanes serve` and a real Prometheus. Bounded: the check stops itself within two minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1 || ! command -v python3 >/dev/null 2>&1; then
  echo "grafana-check: installing Debian's prometheus (and python3)" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus python3 >/dev/null
fi
cargo build -q -p moe-lanes-cli
timeout 150 python3 scripts/grafana-check.py --bin target/debug/moe-lanes
