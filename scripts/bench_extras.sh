#!/usr/bin/env bash
# The alternatives the session benchmark measures beside enot_nb (benchmarks/bench_session.py):
# ipyparallel and nbdistributed, from the package index, with --no-deps so that neither pulls a
# CUDA build of torch over the CPU one; then the few small dependencies they need that .venv
# lacks. Never a runtime or test need.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pip install --no-deps ipyparallel nbdistributed decorator psutil python-dateutil
