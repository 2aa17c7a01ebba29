#!/usr/bin/env bash
# Create .venv with CPU PyTorch and enot_nb (editable) with its test, integrations and browser
# extras. The browser test also needs Debian's chromium: .ci/run installs it (as root).
# torch==2.13.0 is installed first: a CPU build lies on local disk; a plain `pip install torch`
# would pull a multi-GB CUDA build. On a GPU machine, install the CUDA build of your choice first.
# A line per step, and pip's own lines (what it collects, downloads and installs) under it.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(.venv/bin/python -m pip install --disable-pip-version-check)
if [ -x .venv/bin/python ]; then
    echo "setup: [1/3] .venv exists ($(.venv/bin/python --version)); installing into it"
else
    echo "setup: [1/3] creating .venv with $(python3 --version)"
    python3 -m venv .venv
fi
echo "setup: [2/3] torch 2.13.0, the CPU build on this machine's disk (about 1 GB installed)"
"${pip[@]}" "torch==2.13.0"
echo "setup: [3/3] enot_nb (editable) and its extras: test, integrations, browser, docs, ray"
"${pip[@]}" -e ".[test,integrations,browser,docs,ray]"
echo "setup: done: .venv holds torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') and enot_nb"
