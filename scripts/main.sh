#!/usr/bin/env bash
# The main job: set up .venv, then train the example classifier on 2 processes by executing
# notebooks/02_train_classifier.ipynb headless; the executed copy lands in results/. It says what
# it is doing as it goes, and ends with the result and how to open the notebook.
set -euo pipefail
cd "$(dirname "$0")/.."
notebook=notebooks/02_train_classifier.ipynb
executed=results/02_train_classifier.ipynb
echo "main: [1/2] setting up .venv (scripts/setup.sh; a first run installs for a few minutes)"
bash scripts/setup.sh
echo "main: [2/2] training the example classifier on 2 processes: executing $notebook headless"
.venv/bin/python scripts/run_notebook.py "$notebook" "$executed" --show "held-out accuracy:"
echo "main: the executed notebook, with its outputs and loss curve: $PWD/$executed"
echo "main: open it with   .venv/bin/jupyter lab $executed"
echo "main: or as a page:  .venv/bin/jupyter nbconvert --to html $executed   (then open ${executed%.ipynb}.html)"
