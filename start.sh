#!/usr/bin/env bash
# The one command to run the app: sets up .venv on first run, then starts app.py.
#
#   ./start.sh                      # the demo model on http://127.0.0.1:7860
#   ./start.sh --model /models/Qwen2.5-7B-Instruct --mode nf4
#   ./start.sh --setup-only         # only create/update .venv (test.sh uses this)
#
# Set-up is skipped while the requirements are unchanged: their hash (and the Python version)
# is kept in .venv/.requirements.stamp, so a second run starts at once. Edit requirements.txt
# (or requirements-gpu.txt, installed too where nvidia-smi finds a GPU), or delete the stamp,
# and the next run installs again.
#
# Environment: PYTHON picks the interpreter for a new venv (default python3);
# TORCH_INDEX_URL installs torch from another index first, e.g. the CPU-only wheels:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu ./start.sh
set -euo pipefail

cd "$(dirname "$0")"
VENV=.venv
STAMP="$VENV/.requirements.stamp"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
        echo "start.sh: Python 3.11 or newer is needed ($PYTHON is $("$PYTHON" -V 2>&1))" >&2
        exit 1
    }
    echo "start.sh: creating $VENV with $("$PYTHON" -V 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

# On a machine with an NVIDIA GPU, its kernels' packages too (requirements-gpu.txt).
REQUIREMENTS=(requirements.txt)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    REQUIREMENTS+=(requirements-gpu.txt)
fi
want="$(cat "${REQUIREMENTS[@]}" | sha256sum | cut -d' ' -f1) $("$VENV/bin/python" -V 2>&1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    echo "start.sh: installing ${REQUIREMENTS[*]} into $VENV (first run or requirements changed)"
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        "$VENV/bin/python" -m pip install "$(grep -E '^torch==' requirements.txt)" \
            --index-url "$TORCH_INDEX_URL"
    fi
    "$VENV/bin/python" -m pip install -r requirements.txt
    if [ "${#REQUIREMENTS[@]}" -gt 1 ]; then
        # --no-deps: their one heavy need, Triton, comes with torch's CUDA build; letting pip
        # resolve it again could replace the Triton that torch was built against.
        "$VENV/bin/python" -m pip install --no-deps -r requirements-gpu.txt
    fi
    echo "$want" > "$STAMP"  # written only after a complete install
fi

# test.sh reuses this set-up without starting the app.
[ "${1:-}" = "--setup-only" ] && exit 0
exec "$VENV/bin/python" app.py "$@"
