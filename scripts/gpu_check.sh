#!/usr/bin/env bash
# The GPU check, as one command on a machine with a GPU: install what the suite needs from the
# wheels prepared by scripts/gpu_wheels.sh (no network there), run `pytest -m gpu` and the GPU
# benchmark rows, and write a short report to $OUT (or results/gpu). Under 5 minutes.
#   device call: bash scripts/gpu_check.sh      (carry: .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT_DIR="${OUT:-results/gpu}"
mkdir -p "$REPORT_DIR"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
# The kernels the suite starts need a kernelspec; ipykernel provides it from its package.
python3 - <<'PY' > "$REPORT_DIR/machine.txt" 2>&1
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpus", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
start=$(date +%s)
timeout 270 python3 -m pytest -m gpu -o addopts="" -p no:cacheprovider -q -s -rA tests/test_gpu.py \
  > "$REPORT_DIR/pytest.txt" 2>&1
status=$?
{
  echo "# GPU check"
  echo
  cat "$REPORT_DIR/machine.txt"
  echo
  echo "pytest -m gpu: exit $status, $(( $(date +%s) - start )) s"
  tail -n 3 "$REPORT_DIR/pytest.txt"
  echo
  echo "## GPU rows"
  grep -h "GPU-ROW" "$REPORT_DIR/pytest.txt" | sed 's/.*GPU-ROW /* /' || true
} > "$REPORT_DIR/report.md"
cat "$REPORT_DIR/report.md"
exit $status
