#!/usr/bin/env bash
# reproducible.sh - one lent-GPU window for issue "same command, same data" on SGLang (prepared on CPU, not yet run):
# the same job (SmolLM2-135M, 256 demo prompts x 4 samples, 256-token answers) with generation.reproducible=false
# and =true (--enable-deterministic-inference), their generation times side by side, then `pipegen replay --all`
# of the reproducible run at another concurrency (identical?), and the same run with its actor SIGKILLed once
# mid-run (every unit resumed or rerun) replayed against the first.
# Device calls: the GPU kit's two staging calls (see window.sh), then
#   call 3: carry [".gpu/c3", ".gpu/kit"]   bash pipegen/bench/gpu_windows/reproducible.sh   (timeout_s 600)
# Writes to $OUT: BENCH-reproducible.md (the figures) and each step's log.
set -uo pipefail
out=${OUT:-/tmp/pipegen-gpu-out}
mkdir -p "$out"
# shellcheck disable=SC1091
source .gpu/kit/box-env.sh || exit 3
export PIPEGEN_SGLANG_PYTHON=${PIPEGEN_SGLANG_PYTHON:-$(command -v python3)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1 | tee "$out/card.txt"
job=(llm=sglang model_path=smollm2-135m max_samples=256 n=4 max_response_length=256 generation.report=false
     generation.show_progress=false)
took() { grep -o 'this launch: .* in [0-9.]*s' "$1" | grep -o '[0-9.]*s$' | tr -d s; }
for mode in false true; do
  timeout 200 python3 -m pipegen.launch output_dir=/tmp/rep-$mode generation.reproducible=$mode "${job[@]}" \
    > "$out/launch-$mode.log" 2>&1
done
timeout 150 python3 -m pipegen.replay /tmp/rep-true --all actors.concurrency=16 > "$out/replay.log" 2>&1
replay_rc=$?
( timeout 200 python3 -m pipegen.launch output_dir=/tmp/rep-killed generation.reproducible=true "${job[@]}" \
    > "$out/launch-killed.log" 2>&1 ) &
sleep 45; pkill -9 -f "pipegen.actor output_dir=/tmp/rep-killed" ; wait
(python3 - "$out" <<'PY'
import sys
from pathlib import Path
from verl import DataProto
from pipegen.replay import compare, units_of
out = Path(sys.argv[1])
a = DataProto.load_from_disk("/tmp/rep-true/trajectories.pkl")
b = DataProto.load_from_disk("/tmp/rep-killed/trajectories.pkl")
print("killed run vs clean:", compare(a, b, sorted(units_of(a))).line())
PY
) > "$out/killed.txt" 2>&1
{
  echo "card: $(cat "$out/card.txt")"
  echo "generation s, reproducible=false: $(took "$out/launch-false.log"); true: $(took "$out/launch-true.log")"
  echo "replay at concurrency 16 (exit $replay_rc): $(tail -3 "$out/replay.log" | tr '\n' ' ')"
  echo "$(tail -1 "$out/killed.txt")"
} | tee "$out/BENCH-reproducible.md"
