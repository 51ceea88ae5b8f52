#!/usr/bin/env bash
# The engine on a GPU, in one run of under 8 minutes:
#   1. the engine tests with the engine on cuda (BATCHD_TEST_DEVICE=cuda; the generate()
#      oracle stays on the CPU in float32, so the engine runs float32 there too);
#   2. the engine benchmark (generation-heavy preset) on random-init models of real size,
#      Qwen2-0.5B- and Llama-3.2-1B-shaped, in bf16, against transformers' generate_batch on
#      the same GPU and dtype: output tok/s, the ratio, mean running sequences, step time and
#      the share of step time outside the model forward.
# Without a GPU it says so and exits 0.
#
#   scripts/gpu_check.sh                 # uses .venv/bin/python, or $PYTHON
#   GPU_CHECK_REQUESTS=48 scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is false); nothing to check."
    exit 0
fi

OUT=${GPU_CHECK_OUT:-bench-results/gpu_check}
REQUESTS=${GPU_CHECK_REQUESTS:-96}
mkdir -p "$OUT"
"$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")'

echo "== 1. engine tests on cuda"
tests_rc=0
BATCHD_TEST_DEVICE=cuda timeout 150 "$PY" -m pytest tests/engine -q -x -p no:cacheprovider \
    --timeout 100 || tests_rc=$?
echo "engine tests on cuda: exit $tests_rc"

echo "== 2. engine vs generate_batch, real-size shapes, bf16"
bench_rc=0
for model in qwen2-0.5b llama-3.2-1b; do
    dir=$(timeout 60 "$PY" -m benchmarks.real_models "$model" | tail -1) || { bench_rc=1; continue; }
    timeout 100 "$PY" -m benchmarks.engine --model "$dir" --workload generation-heavy \
        --num-requests "$REQUESTS" --systems engine,generate_batch \
        --engine-arg device=cuda --engine-arg dtype=bfloat16 --engine-arg max_model_len=4096 \
        --json "$OUT/$model.json" > "$OUT/$model.txt" 2>&1 || { bench_rc=1; tail -20 "$OUT/$model.txt"; continue; }
    "$PY" - "$model" "$OUT/$model.json" <<'EOF'
import json
import sys

name, path = sys.argv[1], sys.argv[2]
data = json.load(open(path))
eng, hf = data["systems"]["engine"], data["systems"]["generate_batch"]
stats, whole = eng["engine_stats"], eng["phases"]["all"]  # phase times are device-synced
ratio = data["ratios"]["engine / generate_batch (output tok/s)"]
print(f"{name} ({data['dtype']} on {data['device']}): engine {eng['output_tok_s']:,.0f} output tok/s, "
      f"generate_batch {hf['output_tok_s']:,.0f} ({hf['attn_implementation']}), ratio {ratio:.2f}x; "
      f"mean running seqs {stats['mean_running_seqs']:.1f}, "
      f"mean step {1000 * whole['time_s'] / max(1, whole['steps']):.1f} ms, "
      f"outside the forward {whole['outside_forward_frac']:.0%} (time in phases: "
      + ", ".join(f"{k} {v['time_share']:.0%}" for k, v in eng["phases"]["phases"].items())
      + f"); greedy agreement {data['agreement']['engine vs generate_batch']:.0%}")
EOF
done
echo "gpu_check: engine tests exit $tests_rc, benchmarks exit $bench_rc (reports in $OUT)"
exit $(( tests_rc || bench_rc ))
