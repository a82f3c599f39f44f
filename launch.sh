#!/usr/bin/env bash
# colocate launcher.
#   ./launch.sh                         set up (first run) and train on configs/default.yaml
#   ./launch.sh CONFIG.yaml [FLAGS...]  train with a config; FLAGS override it (--train.lr 1e-6)
#   ./launch.sh test [PYTEST ARGS...]   set up (first run) and run the tests
# Environment: NPROC (processes, default: number of GPUs, or 1 on CPU), NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT (multi-node rendezvous), PYTHON (interpreter, default python3).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

setup() {
  if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "[launch] installing torch"
    "$PYTHON" -m pip install -q "torch>=2.9"
  fi
  if ! "$PYTHON" -c "import colocate, tyro, pytest" 2>/dev/null; then
    echo "[launch] installing colocate and its dependencies"
    "$PYTHON" -m pip install -q -e ".[dev]"
  fi
}

setup
if [[ "${1:-}" == "test" ]]; then
  shift
  exec "$PYTHON" -m pytest -q tests "$@"
fi

config=configs/default.yaml
if [[ $# -gt 0 && "$1" != -* ]]; then
  config=$1
  shift
fi
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
nproc=${NPROC:-$(( gpus > 0 ? gpus : 1 ))}
nnodes=${NNODES:-1}
if [[ "$nnodes" -gt 1 ]]; then
  rdzv=(--nnodes "$nnodes" --node-rank "${NODE_RANK:?set NODE_RANK}" --rdzv-backend c10d
        --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}")
else
  rdzv=(--standalone)
fi
if [[ "$gpus" -gt 0 ]]; then
  # The native engine's pausable CUDA graphs need torch_memory_saver's hook preloaded (the SGLang
  # backend preloads it into its own scheduler process instead and refuses a second copy).
  preload=$("$PYTHON" -m colocate.memory_saver "$config" "$@" 2>/dev/null || true)
  [[ -n "$preload" ]] && export LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}"
fi
exec "$PYTHON" -m torch.distributed.run "${rdzv[@]}" --nproc-per-node "$nproc" \
  -m colocate.train --config "$config" "$@"
