#!/usr/bin/env bash
# The one prepared script for a TPU machine, run from the repository root there:
#
#     bash experiments/tpu_session.sh
#
# On a TPU VM without JAX's TPU backend it first installs this checkout with the `tpu` extra (pip install -e
# ".[tpu]": jax[tpu] and its libtpu). Then, each part under its own time limit so one slow compile cannot eat the
# rest (about 10 minutes in all at most): the chip and what its allocator offers, the memory plan `jsgl serve` would
# make for Llama-3-8B on it, and `jsgl bench device --platform tpu`: attention at Llama-3-8B's shapes through jsgl's
# Mosaic kernel, the pure-JAX path and jax's ragged paged attention against the HBM floor; the engine against
# transformers on tiny checkpoints; Llama-3-8B-shaped whole steps. Everything goes to $OUT/tpu_session.log (./out
# without $OUT). Without a TPU it runs the same parts at smoke size (the kernels interpreted), which is how it is
# checked on CPU.
set -uo pipefail
# shellcheck source=session_common.sh
source "$(dirname "$0")/session_common.sh" tpu_session
backend() { "$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null; }
# A TPU VM shows its chips as /dev/accel* (v4, v5e) or VFIO devices (v5p, v6e); a GPU machine is not one.
tpu_chips() {
    { compgen -G "/dev/accel*" || compgen -G "/dev/vfio/[0-9]*"; } >/dev/null && ! command -v nvidia-smi >/dev/null
}

if { tpu_chips && [ "$(backend)" != tpu ]; } || ! "$PY" -c "import jsgl.experiments" 2>/dev/null; then
    extra="$(tpu_chips && echo '[tpu]')"
    echo "installing this checkout: pip install -e \".$extra\""
    "$PY" -m pip install -q -e ".$extra" || exit 1
fi
SMOKE=()
if [ "$(backend)" != tpu ]; then
    echo "no TPU backend here: every part runs at smoke size (kernels interpreted)"
    SMOKE=(--cpu-smoke)
fi
"$PY" - <<'EOF'
import sys, jax
d = jax.devices()[0]
print("python", sys.version.split()[0], "jax", jax.__version__, "backend", jax.default_backend(),
      len(jax.devices()), "x", d.device_kind)
print("memory_stats", {k: v for k, v in (d.memory_stats() or {}).items() if "limit" in k or "reserv" in k})
if jax.default_backend() == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    print(pltpu.get_tpu_info())
EOF

# The plan `jsgl serve` would make for Llama-3-8B on this chip, from its config alone. Informative: on a 16 GiB chip
# (v5e) the 16 GB of bf16 weights do not fit, which the plan says by name; that is not a failure of this script.
CFG="$(mktemp -d)"
"$PY" -c "import json, sys; from jsgl.model.config import LLAMA3_8B; json.dump(LLAMA3_8B, open(sys.argv[1], 'w'))" \
    "$CFG/config.json"
for flags in "" "--kv-dtype int8"; do
    echo "===== memory plan, Llama-3-8B, ${flags:-defaults}"
    # shellcheck disable=SC2086  # the flags are words
    timeout 60 "$PY" -m jsgl.cli serve --dry-run --model "$CFG" $flags || echo "(the plan's exit status: $?)"
done

BENCH=("$PY" -m jsgl.cli bench device --platform tpu "${SMOKE[@]}")
part 210 "attention: jsgl's tpu kernel, pure JAX, jax's ragged paged attention (bf16, int8 KV; decode, extend)" \
    "${BENCH[@]}" --skip-engine --skip-steps
part 120 "engine vs transformers, tiny checkpoints (tpu attention)" "${BENCH[@]}" --skip-kernels --skip-steps
part 210 "Llama-3-8B-shaped steps (bf16 weights; KV bf16, then int8; tpu attention)" "${BENCH[@]}" --skip-kernels \
    --skip-engine --step-layers scanned --step-kv-dtypes bfloat16 int8
echo "tpu_session: $([ $status -eq 0 ] && echo 'all parts passed' || echo 'SOME PARTS FAILED')"
exit $status
