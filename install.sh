#!/usr/bin/env bash
# Installs trickles (editable) into the active Python environment.
#   bash install.sh          runtime + plots (for the demo)
#   bash install.sh test     + Hugging Face interop and pytest (for the test suite)
#   bash install.sh all      everything, TensorBoard included
#   bash install.sh serve    + FastAPI and uvicorn (trickles serve); also hf, plots, tensorboard one by one
# An existing torch (CPU or CUDA build) is kept as it is. When there is none, torch 2.13.0 is
# installed first; on a machine whose pip finds a local CPU wheel of it, that wheel is used.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
case "${1:-demo}" in
  demo|test|all|hf|plots|tensorboard|serve|grammar) extras=${1:-demo} ;;
  *) echo "usage: bash install.sh [demo|test|all|hf|plots|tensorboard|serve|grammar]" >&2; exit 2 ;;
esac
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[${extras}]"
