#!/usr/bin/env bash
# The main job: set up .venv, then train the example classifier on 2 processes by executing
# notebooks/02_train_classifier.ipynb headless; the executed copy lands in results/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/run_notebook.py notebooks/02_train_classifier.ipynb \
    results/02_train_classifier.ipynb
