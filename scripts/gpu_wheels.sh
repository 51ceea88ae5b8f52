#!/usr/bin/env bash
# The Python packages that scripts/gpu_check.sh needs on a GPU machine with no network, as
# wheels: the machine's image holds Python 3.12, torch 2.11.0 (CUDA), transformers 5.17.0
# and their own dependencies (numpy, safetensors, tokenizers, huggingface-hub, typer, tqdm,
# jinja2, ...); the engine, its tests (tests/engine) and the benchmarks
# (benchmarks.engine, benchmarks.real_models) need the packages below beside them. They are
# fetched here as cp312 manylinux x86-64 wheels, one version of each, without their
# dependencies (the list is closed by hand), into wheels/gpu (ignored by git), and must stay
# within 64 MiB together: what travels to the device machine is at most 64 MiB.
#
#   scripts/gpu_wheels.sh            # fetch into wheels/gpu (emptied first), print the total
#   scripts/gpu_wheels.sh --check    # only sum what is there: exit 1 if over the limit
#   GPU_WHEELS_DIR=/tmp/w GPU_WHEELS_LIMIT_MIB=64 scripts/gpu_wheels.sh
#
# On the GPU machine, scripts/gpu_check.sh installs them itself when it finds the directory:
#   python3 -m pip install --no-index --no-deps --no-compile --target /tmp/batchd-gpu-site \
#       wheels/gpu/*.whl && export PYTHONPATH=/tmp/batchd-gpu-site
# (docs/gpu.md: how the directory travels, with the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${GPU_WHEELS_DIR:-wheels/gpu}
LIMIT_MIB=${GPU_WHEELS_LIMIT_MIB:-64}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

# name==version, the versions of the project's own environment where it has them.
PACKAGES=(
    # the test runner (tests/engine, with per-test timeouts)
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0
    # structured outputs (engine/text/structured.py)
    llguidance==1.9.1
    # tests/engine/text/test_structured.py and test_smollm2.py validate JSON against schemas
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
    rpds-py==2026.9.1 attrs==26.1.0
    # core.settings, which core.llms.demo (the tests' models) reads: pydantic-settings, and
    # pydantic itself, which the image's package list does not name (the typer that
    # transformers 5.17 pulls in here needs it; the image's may not)
    pydantic-settings==2.16.3 python-dotenv==1.2.4
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
)

# Wheels for glibc up to 2.39 run there (its Python is 3.12.3, as on Ubuntu 24.04); pip
# matches each platform tag exactly, so each is named.
PLATFORMS=(manylinux_2_{39,35,34,31,28,27,24,17}_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any)

check() {
    local names dup
    if ! compgen -G "$DIR/*.whl" > /dev/null; then
        echo "gpu_wheels: no wheels in $DIR; run scripts/gpu_wheels.sh" >&2
        return 1
    fi
    # Two versions of one package stop the whole install: one of each.
    names=$(for w in "$DIR"/*.whl; do basename "$w" | cut -d- -f1 | tr 'A-Z-' 'a-z_'; done)
    dup=$(sort <<< "$names" | uniq -d | paste -sd' ')
    if [ -n "$dup" ]; then
        echo "gpu_wheels: more than one wheel of: $dup (in $DIR)" >&2
        return 1
    fi
    # Apparent sizes, in bytes, against the limit; printed in MiB.
    "$PY" - "$DIR" "$LIMIT_MIB" <<'EOF'
import sys
from pathlib import Path

wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
total, limit = sum(p.stat().st_size for p in wheels), float(sys.argv[2])
print(f"gpu_wheels: {len(wheels)} wheels in {sys.argv[1]}, {total / 2**20:.2f} MiB together "
      f"(limit {sys.argv[2]} MiB)")
if total > limit * 2**20:
    sys.exit(f"gpu_wheels: {total} bytes is over the {sys.argv[2]} MiB limit")
EOF
}

if [ "${1:-}" = "--check" ]; then
    check
    exit $?
fi

rm -rf "$DIR"
mkdir -p "$DIR"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    "${PLATFORMS[@]/#/--platform=}" -d "$DIR" "${PACKAGES[@]}" 2>&1 |
    grep -v "^WARNING: Location 'file:" || true
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_wheels: pip download failed" >&2; exit 1; }
ls -1 "$DIR"
check
