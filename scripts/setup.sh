#!/usr/bin/env bash
# Create .venv with CPU PyTorch and enot_nb (editable) with its test, integrations and browser
# extras. The browser test also needs Debian's chromium: .ci/run installs it (as root).
# torch==2.13.0 is installed first: a CPU build lies on local disk; a plain `pip install torch`
# would pull a multi-GB CUDA build. On a GPU machine, install the CUDA build of your choice first.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test,integrations,browser,docs,ray]"
