#!/usr/bin/env bash
# Prepare, on the CPU machine, the wheels the GPU suite needs on a lent GPU machine (Python 3.12,
# manylinux x86-64, no network there): IPython, ipykernel, jupyter_client, nbclient and what they
# need. They land in .whl/ (git-ignored through .git/info/exclude, never committed) and travel
# with the `carry` of the device call; scripts/gpu_check.sh installs them from there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
PACKAGES=(
  ipython ipython-pygments-lexers traitlets decorator jedi parso matplotlib-inline pexpect
  ptyprocess prompt-toolkit wcwidth pygments stack-data executing asttokens pure-eval
  ipykernel comm debugpy nest-asyncio psutil pyzmq tornado jupyter-client jupyter-core
  platformdirs python-dateutil six nbclient nbformat fastjsonschema jsonschema attrs
  referencing rpds-py jsonschema-specifications pytest-timeout
)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl "${PACKAGES[@]}"
du -sh .whl
