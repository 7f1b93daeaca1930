#!/usr/bin/env bash
# window.sh SIZE - one lent-GPU window of `python -m pipegen.bench --only gpu` for one model size
# (small: SmolLM2-135M, 16-token answers; medium: Qwen3-0.6B-class, 256; large: Qwen3-8B-class, 1,024; random
# weights, see pipegen/bench/gpu.py). small.sh, medium.sh and large.sh call it.
#
# On the lent box, as the device tool's third call of a window, after the two staging calls of the GPU kit
# (its build-payload.sh writes .gpu/c1 .gpu/c2 .gpu/c3 .gpu/kit in the checkout; ignored by git):
#   call 1: carry [".gpu/c1"]               mkdir -p /tmp/stage && cp .gpu/c1/* /tmp/stage/
#   call 2: carry [".gpu/c2"]               mkdir -p /tmp/stage && cp .gpu/c2/* /tmp/stage/
#   call 3: carry [".gpu/c3", ".gpu/kit"]   bash pipegen/bench/gpu_windows/small.sh      (timeout_s 600)
# Budget of call 3 (one H100, estimated): kit unpack and model conversion ~40 s, SGLang ready ~120 s (flashinfer's
# JIT and CUDA graphs up to --cuda-graph-max-bs), warm-up ~10 s, pipegen's launch ~35 s of start-up + a window of
# >= 30 s + its merge, the raw loop >= 30 s, the offline engine ~90 s to load + >= 30 s: ~7-8 min under the
# 9 min this script allows, so the three calls fit one 15-minute device window.
# Writes to $OUT (what comes back): BENCH-gpu-SIZE.md (the table rows), bench-gpu-SIZE.log, and the
# servers' and arms' logs under gpu-SIZE/.
set -uo pipefail
size=${1:?usage: window.sh small|medium|large}
out=${OUT:-/tmp/pipegen-gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source .gpu/kit/box-env.sh || exit 3
export PIPEGEN_SGLANG_PYTHON=${PIPEGEN_SGLANG_PYTHON:-$(command -v python3)}
export PIPEGEN_BENCH_GPU_SIZES=$size PIPEGEN_BENCH_SGLANG_ARGS=${PIPEGEN_BENCH_SGLANG_ARGS:-$SGL_FLAGS}
export PIPEGEN_BENCH_GPU_DIR=/tmp/pipegen-gpu-$size
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1
started=$SECONDS
timeout 540 python3 -m pipegen.bench --only gpu --out "$out/BENCH-gpu-$size.md" > "$out/bench-gpu-$size.log" 2>&1
rc=$?
echo "[window] bench exited $rc after $((SECONDS - started)) s"
mkdir -p "$out/gpu-$size"
find "$PIPEGEN_BENCH_GPU_DIR" -maxdepth 3 -name '*.log' -size -4M -exec cp {} "$out/gpu-$size/" \; 2>/dev/null
grep -E '^\| (8\.|) ' "$out/BENCH-gpu-$size.md" 2>/dev/null | cut -c1-600
tail -25 "$out/bench-gpu-$size.log"
exit $rc
