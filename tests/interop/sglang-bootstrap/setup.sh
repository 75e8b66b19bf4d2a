#!/usr/bin/env bash
# Build a venv with sglang 0.5.23 (--no-deps) plus the six light deps the bootstrap server needs.
# Idempotent. Needs python3.11 (the sglang wheel is cp311).
# VENV=/some/writable/dir puts the venv there (default: .venv beside this script). Use it where this
# folder is read-only:  VENV=target/sglang-venv tests/interop/sglang-bootstrap/setup.sh
# SGLANG_WHEEL=/path/to/sglang-0.5.23-*.whl uses a local wheel instead of the package index.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${VENV:-$here/.venv}"
[ -x "$venv/bin/python" ] || python3.11 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q --no-deps "${SGLANG_WHEEL:-sglang==0.5.23}"
"$venv/bin/python" -m pip install -q -r "$here/requirements.txt"
"$venv/bin/python" -c "import importlib.metadata as m; print('sglang', m.version('sglang'))"
echo "start the server with: $venv/bin/python $here/bootstrap_server.py --port PORT"
