#!/usr/bin/env bash
# The one prepared script for a lent GPU machine, run from the repository root there:
#
#     bash experiments/gpu_session.sh
#
# jsgl is installed over the machine's own jax and torch (wheels of what that image lacks in .whl/, made with
# `pip download` as docs/gpu.md says; nothing is fetched there), then, each part under its own time limit so one
# slow compile cannot eat the rest: the device and what its allocator offers, the memory plan for Llama-3-8B,
# and `jsgl bench device` (the Pallas kernels against the reference, the engine end to end against transformers
# on tiny checkpoints, Llama-3-8B-shaped steps). Everything goes to $OUT/gpu_session.log (./out without $OUT).
# Without a GPU it runs the same parts at smoke size (Pallas interpreted), which is how it is checked on CPU.
set -uo pipefail
# shellcheck source=session_common.sh
source "$(dirname "$0")/session_common.sh" gpu_session

if [ -d .whl ] && command -v nvidia-smi >/dev/null; then  # on the lent machine: this checkout's jsgl plus what the image lacks, beside (not over) the image's packages
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --target /tmp/jsgl-site .whl/*.whl . \
        || exit 1
    export PYTHONPATH=/tmp/jsgl-site
fi
SMOKE=()
if ! nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null; then
    echo "no NVIDIA GPU here: every part runs at smoke size"
    SMOKE=(--cpu-smoke)
fi
"$PY" - <<'EOF'
import sys, jax
d = jax.devices()[0]
print("python", sys.version.split()[0], "jax", jax.__version__, "backend", jax.default_backend(), d.device_kind)
print("memory_stats", {k: v for k, v in (d.memory_stats() or {}).items() if "limit" in k or "reserv" in k})
EOF

# The plan `jsgl serve` would make for Llama-3-8B on this device, from its config alone.
CFG="$(mktemp -d)"
"$PY" -c "import json, sys; from jsgl.model.config import LLAMA3_8B; json.dump(LLAMA3_8B, open(sys.argv[1], 'w'))" \
    "$CFG/config.json"
part 60 "memory plan, Llama-3-8B, defaults" "$PY" -m jsgl.cli serve --dry-run --model "$CFG"
part 60 "memory plan, Llama-3-8B, --mem-fraction 0.9" "$PY" -m jsgl.cli serve --dry-run --model "$CFG" \
    --mem-fraction 0.9

BENCH=("$PY" -m jsgl.cli bench device "${SMOKE[@]}")
part 150 "kernels vs reference (decode, split-K decode, extend; bf16, f32, int8 KV)" "${BENCH[@]}" --skip-steps \
    --skip-engine
part 120 "engine vs transformers, tiny checkpoints" "${BENCH[@]}" --skip-steps --kv-heads 8 --dtypes bfloat16 \
    --splitk-batch 0 --skip-extend
part 240 "Llama-3-8B-shaped steps (bf16 weights; KV bf16, then int8)" "${BENCH[@]}" --skip-engine --kv-heads 8 \
    --dtypes bfloat16 --splitk-batch 0 --skip-extend --step-kv-dtypes bfloat16 int8
echo "gpu_session: $([ $status -eq 0 ] && echo 'all parts passed' || echo 'SOME PARTS FAILED')"
exit $status
