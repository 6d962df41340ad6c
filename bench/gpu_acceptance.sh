#!/usr/bin/env bash
# GPU acceptance in one command, on a machine with one or more NVIDIA GPUs:
#   bench/gpu_acceptance.sh [--budget-s 450]
# Runs the gpu-marked tests and the throughput/MFU/memory cases (bench/gpu_acceptance.py),
# prints one table and writes bench/results/gpu_acceptance.json. Each case has its own
# timeout; a failed case is a row of the table, not an abort. Installs nothing: it uses
# $PYTHON, else .venv/bin/python, else python3, which must have CUDA torch and
# `pip install -e '.[dev]'` (README: Install). Budget: under 8 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import kforge_cli, torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; then
    echo "gpu_acceptance: $PY cannot import kforge_cli with a CUDA torch." >&2
    echo "  Install: python3 -m venv .venv && . .venv/bin/activate && pip install torch && pip install -e '.[dev]'" >&2
    exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
exec "$PY" bench/gpu_acceptance.py run "$@"
