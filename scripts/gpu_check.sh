#!/usr/bin/env bash
# The checks that need a CUDA device, in one run of under 8 minutes, printing every figure:
#   1. the CUDA tests (Triton kernels compiled for the device, the engine on the Triton backend);
#   2. benchmarks/kernels.py: paged decode attention's bandwidth as a fraction of the device's
#      peak, on the 16-bit and the 8-bit caches;
#   3. benchmarks/engine.py on the default model (SmolLM2-135M-Instruct) in bfloat16 with the
#      Triton backend, beside transformers on the same device: tokens/s, TTFT, agreement;
#   4. benchmarks/kv_tiers.py: the host tier's restore into the pool (pinned host memory) as a
#      fraction of a plain pinned host-to-device copy of the same bytes.
# On a machine with one CUDA device and what the README installs (a CUDA torch first):
#   bash scripts/gpu_check.sh [PEAK_BYTES_PER_S]     # default: an H200's 4.8e12
# Each step has its own time limit; a failed step is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
PEAK="${1:-4.8e12}"
failed=0

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local t0=$SECONDS
    if ! timeout "$limit" "$@"; then
        echo "!! $name failed or ran past ${limit} s"
        failed=1
    fi
    echo "== $name: $((SECONDS - t0)) s"
}

python3 - <<'EOF' || exit 1
import torch
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device: this check needs one (torch %s)" % torch.__version__)
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}, "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

step "CUDA tests" 210 python3 -m pytest -q -p no:randomly \
    tests/test_kernels.py tests/test_triton_engine.py tests/test_kv_quant.py tests/test_torch_sdpa.py
step "decode attention bandwidth" 90 python3 -m benchmarks.kernels --peak-bw "$PEAK" \
    --kv-cache-dtype auto,int8,fp8_e4m3
step "engine, default model, bfloat16, Triton" 150 python3 -m benchmarks.engine --model default \
    --device cuda --dtype bfloat16 --threads 0 --docs 4 --questions 4 --chats 8
step "KV host-tier restore bandwidth" 90 python3 -m benchmarks.kv_tiers --model default \
    --cases restore_bandwidth --device cuda
exit $failed
