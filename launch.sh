#!/usr/bin/env bash
# colocate launcher.
#   ./launch.sh                         set up (first run) and train on configs/default.yaml
#   ./launch.sh [train] CONFIG.yaml [FLAGS...]
#                                       train with a config; FLAGS override it (--train.lr 1e-6;
#                                       CONFIG.yaml --help lists them)
#   ./launch.sh COMMAND [ARGS...]       set up (first run) and run `colocate COMMAND ARGS...`, one of
#                                       generate, export, parity, plot, data, toy (COMMAND --help)
#   ./launch.sh test [PYTEST ARGS...]   set up (first run) and run the tests not marked slow
#   ./launch.sh test --all [ARGS...]    the whole CPU suite, slow end-to-end runs included (CI's)
#   ./launch.sh test-gpu                the 1-GPU smoke: the toy loop for 10 steps, then the GPU-marked
#                                       unit tests (kernels, losses, rotary, sampling) on the device
# Set-up: a virtual environment in .venv (made with uv when it is installed, else python3 -m venv)
# with torch $TORCH_VERSION and this checkout (editable) installed. Without an NVIDIA GPU, torch is
# the CPU build, from PyTorch's CPU wheel index ($TORCH_CPU_INDEX; empty skips it) when that answers;
# with one, it is the CUDA build plus torch_memory_saver. It runs again when pyproject.toml changes.
# Environment: NPROC (processes, default: number of GPUs, or 1 on CPU), NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT (multi-node rendezvous), PYTHON (an interpreter to run instead of .venv;
# torch, if missing, and this checkout are installed into it), TORCH_CPU_INDEX.
set -euo pipefail
cd "$(dirname "$0")"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p;}' "$0"  # the comment above
  exit 0
fi
TORCH_VERSION=2.13.0  # the torch the project is tested with
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}

has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

pip_install() {
  if [[ -n "$use_uv" ]]; then
    uv pip install -q --python "$py" "$@"
  else
    "$py" -m pip install -q "$@"
  fi
}

# The torch build and project extras this machine needs, as one line (the set-up stamp).
wanted() {
  if has_nvidia_gpu; then
    echo "torch==$TORCH_VERSION cuda .[gpu,dev] $(cksum < pyproject.toml)"
  else
    echo "torch==$TORCH_VERSION cpu .[dev,interpret] $(cksum < pyproject.toml)"
  fi
}

install_torch() {
  local torch build index=()
  read -r torch build _ <<< "$1"
  if [[ "$build" == cpu && "$(uname -s)" == Linux && -n "$TORCH_CPU_INDEX" ]]; then
    # PyPI's Linux torch is the multi-GB CUDA build. A short probe first: pip retries an index
    # that does not answer for tens of seconds.
    if "$py" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" \
        "$TORCH_CPU_INDEX/torch/" 2>/dev/null; then
      index=(--extra-index-url "$TORCH_CPU_INDEX")
    else
      echo "[launch] $TORCH_CPU_INDEX does not answer: torch comes from the default index"
    fi
  fi
  echo "[launch] installing $torch ($build build) into $py"
  pip_install ${index[@]+"${index[@]}"} "$torch"
}

install_project() {
  local extras
  read -r _ _ extras _ <<< "$1"
  echo "[launch] installing colocate $extras and its dependencies"
  pip_install -e "$extras"
}

if [[ -n "${PYTHON:-}" ]]; then
  # The user's interpreter: a torch it has stays as it is, unless older than pyproject.toml allows.
  py=$PYTHON use_uv=
  "$py" -c "import torch" 2>/dev/null || install_torch "$(wanted)"
  "$py" -m pip show -q colocate >/dev/null 2>&1 || install_project "$(wanted)"
else
  py=.venv/bin/python use_uv=
  if [[ ! -x "$py" ]]; then
    echo "[launch] creating the virtual environment .venv"
    if command -v uv >/dev/null 2>&1; then
      uv venv -q .venv
    else
      python3 -m venv .venv
    fi
  fi
  if ! "$py" -m pip --version >/dev/null 2>&1; then
    use_uv=1  # uv makes environments without pip
  fi
  stamp=.venv/colocate-setup
  want=$(wanted)
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    install_torch "$want"
    install_project "$want"
    echo "$want" > "$stamp"
  fi
fi

if [[ "${1:-}" == "test" ]]; then
  shift
  marker=(-m "not slow")
  if [[ "${1:-}" == --all ]]; then
    shift
    marker=()
  fi
  targets=(tests)  # the whole suite, unless the arguments name test files or folders
  for arg in "$@"; do
    [[ "$arg" != -* && -e "${arg%%::*}" ]] && targets=()
  done
  exec "$py" -m pytest -q "${marker[@]}" "${targets[@]}" "$@"
fi

mark_exec() {
  # A process that this script becomes with exec keeps its id and start time, so its age would
  # count the set-up above: colocate's `process` start-up phase counts from here (colocate/timing.py).
  local up
  if [[ -r /proc/uptime ]] && read -r up _ < /proc/uptime; then
    export COLOCATE_EXEC_UPTIME=$up
  fi
  return 0
}

case "${1:-}" in
  generate|export|parity|plot|data|toy)
    mark_exec
    exec "$py" -m colocate "$@" ;;
  train)
    shift ;;
esac

probe() {
  # One Python process, as importing torch takes seconds on a GPU machine: sets `gpus` (the CUDA
  # devices torch sees) and preloads torch_memory_saver's hook when the run's native engine needs it
  # for pausable CUDA graphs (the SGLang backend preloads it into its own scheduler process and
  # refuses a second copy). A config the probe cannot read leaves the error to the run itself, and
  # --help (whose text the probe prints instead of a count) leaves the help to it.
  local out lines
  out=$("$py" -m colocate.memory_saver --gpus "$@" 2>/dev/null) && [[ "${out%%$'\n'*}" =~ ^[0-9]+$ ]] ||
    out=$("$py" -c "import torch; print(torch.cuda.device_count())")
  readarray -t lines <<< "$out"
  gpus=${lines[0]}
  [[ -n "${lines[1]:-}" ]] && export LD_PRELOAD="${lines[1]}${LD_PRELOAD:+:$LD_PRELOAD}"
  return 0
}

if [[ "${1:-}" == "test-gpu" ]]; then
  has_nvidia_gpu || { echo "[launch] test-gpu needs an NVIDIA GPU; ./launch.sh test runs the CPU tests" >&2; exit 2; }
  smoke_dir=$(mktemp -d)
  trap 'rm -rf "$smoke_dir"' EXIT
  start=$SECONDS
  (probe configs/default.yaml
   mark_exec
   "$py" -m colocate.train --config configs/default.yaml --train.num_rollout 10 --output-dir "$smoke_dir/run")
  loop_s=$((SECONDS - start))
  rc=0
  "$py" -m pytest -q -m gpu tests/unit || rc=$?
  echo "[launch] test-gpu: toy loop ${loop_s} s, GPU unit tests $((SECONDS - start - loop_s)) s, total $((SECONDS - start)) s"
  exit $rc
fi

config=configs/default.yaml
if [[ $# -gt 0 && "$1" != -* ]]; then
  config=$1
  shift
fi
probe "$config" "$@"
nproc=${NPROC:-$(( gpus > 0 ? gpus : 1 ))}
nnodes=${NNODES:-1}
if [[ "$nproc" -eq 1 && "$nnodes" -eq 1 ]]; then
  # One process needs no torchrun: a user error is then the last line printed.
  mark_exec
  exec "$py" -m colocate.train --config "$config" "$@"
fi
# Under torchrun a rank's one-line error ends up above torchrun's failure report: check the config
# and that its batches divide among the processes first, so that such an error is the last line.
"$py" -m colocate.memory_saver --world-size "$((nproc * nnodes))" "$config" "$@" || exit
if [[ "$nnodes" -gt 1 ]]; then
  rdzv=(--nnodes "$nnodes" --node-rank "${NODE_RANK:?set NODE_RANK}" --rdzv-backend c10d
        --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}")
else
  rdzv=(--standalone)
fi
# torchrun starts each rank in a session of its own, out of reach of the terminal's Ctrl-C, and would
# answer a SIGINT of its own with a traceback and a SIGKILL of the ranks 30 s later: it ignores SIGINT,
# and this script hands SIGINT and SIGTERM to the ranks, which stop cleanly (colocate/stopping.py).
# Before the ranks exist, a signal goes to torchrun as SIGTERM. A SIGTERM that reaches torchrun itself
# (a scheduler signalling the whole group) gives the ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds to
# finish the step and save. A clean stop exits 0 under torchrun; this script then exits 130 (SIGINT)
# or 143 (SIGTERM).
signal_ranks() {
  pkill "-$1" -P "$agent" 2>/dev/null || kill -TERM "$agent" 2>/dev/null || true
}
stopped_by=0
trap 'stopped_by=130; signal_ranks INT' INT
trap 'stopped_by=143; signal_ranks TERM' TERM
(trap '' INT
 export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}
 exec "$py" -m torch.distributed.run "${rdzv[@]}" --signals-to-handle SIGTERM,SIGHUP,SIGQUIT \
   --nproc-per-node "$nproc" -m colocate.train --config "$config" "$@") &
agent=$!
while kill -0 "$agent" 2>/dev/null; do
  wait "$agent" || true  # returns early when a trapped signal arrives
done
rc=0
wait "$agent" || rc=$?  # its exit status, which bash keeps
if [[ $rc -eq 0 && $stopped_by -ne 0 ]]; then
  exit "$stopped_by"
fi
exit "$rc"
