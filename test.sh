#!/usr/bin/env bash
# The test command: sets up .venv as start.sh does, adds the test tools, makes sure Debian's
# Chromium is there for the browser tests, then runs the whole suite on the CPU.
#
#   ./test.sh                 # everything
#   ./test.sh tests/ui -x     # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")"

./start.sh --setup-only
.venv/bin/python -m pip install -q -r requirements-test.txt

# Playwright drives the system Chromium (its own browser download is not used).
if [ ! -x "${CHROMIUM:-/usr/bin/chromium}" ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -q && apt-get install -y -q chromium
    else
        echo "test.sh: the browser tests need Chromium: sudo apt-get install chromium" >&2
        exit 1
    fi
fi

exec .venv/bin/python -m pytest tests "$@"
