#!/usr/bin/env bash
# The compatibility job: the core of the launcher, one-off cell, session and functional suites
# (their tests not marked slow) on one torch release and one Python, in a venv of their own,
# .venv-compat-<torch>-py<python>. CI (.ci/run) runs it for the newest torch that installs here and
# for the oldest pair pyproject.toml claims:
#
#   bash scripts/compat.sh TORCH_VERSION [PYTHON_VERSION]      e.g. bash scripts/compat.sh 2.4.1 3.10
#
# Only torch 2.13.0 (CPU, Python 3.11) and 2.14.1 (Python 3.11) lie on this machine's disk; any other
# pair is a CUDA build of about 2.5 GB that pip downloads (its cache keeps it), about 5 GB in the venv,
# which is kept for the next run. PYTHON_VERSION (default 3.11) is found as pythonX.Y on PATH, else
# among pyenv's versions.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=${1:?usage: bash scripts/compat.sh TORCH_VERSION [PYTHON_VERSION]}
python_version=${2:-3.11}

find_python() {
    local version=$1 exe found=""
    # A pyenv shim is on PATH for every version it holds, but runs only where that one is selected.
    if exe=$(command -v "python$version") && "$exe" -c "" 2>/dev/null; then
        echo "$exe"
        return
    fi
    for exe in "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$version".*/bin/"python$version"; do
        [ -x "$exe" ] && found=$exe
    done
    [ -n "$found" ] || { echo "compat: no Python $version on PATH or in pyenv" >&2; return 1; }
    echo "$found"
}

SECONDS=0
venv=.venv-compat-$torch_version-py$python_version
if [ ! -x "$venv/bin/python" ]; then
    python=$(find_python "$python_version")
    echo "compat: creating $venv with $python"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
echo "compat: installing torch==$torch_version into $venv"
"${pip[@]}" "torch==$torch_version"
echo "compat: installing enot_nb[test] (editable) into $venv"
"${pip[@]}" -e ".[test]"
# pip keeps an installed torch that meets the claim; anything else means the claim changed.
"$venv/bin/python" - "$torch_version" <<'EOF'
import sys, torch
got = torch.__version__.split("+")[0]
assert got == sys.argv[1], f"compat: the venv holds torch {got}, not {sys.argv[1]}"
print(f"compat: torch {torch.__version__} on Python {sys.version.split()[0]}")
EOF
echo "compat: installed in ${SECONDS} s; running the core suites"
set +e
"$venv/bin/python" -m pytest -m "not slow" tests/launcher tests/cells tests/session tests/distributed
rc=$?
set -e
echo "compat: torch $torch_version on Python $python_version: pytest exit $rc after ${SECONDS} s in all"
exit "$rc"
