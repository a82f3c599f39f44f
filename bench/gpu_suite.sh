#!/usr/bin/env bash
# Every GPU check of one machine in one go: GPU-marked tests, the default run, and the benchmarks.
#   bench/gpu_suite.sh OUT_DIR [STEP...]   steps: loop default engine e2e rollout prefill colocation train
#                                          train_small kernels units
#                                          (and, asked for by name: fp8 multiturn tail e2e_tail_off e2e_tail_on startup
#                                          startup_4b sizing on_policy_bits on_policy invariant_sweep lora lora_8b;
#                                          multigpu, on a machine of 2 or more GPUs)
# Logs go to OUT_DIR/<step>.log, benchmark JSON to bench/results/ and, for the files this run wrote,
# OUT_DIR; one line per step.
set -u
out=${1:?usage: bench/gpu_suite.sh OUT_DIR [STEP...]}
shift
steps=${*:-loop default engine e2e rollout prefill colocation train train_small kernels units}
mkdir -p "$out"
marker=$(mktemp)
export PYTHONUNBUFFERED=1

run() {
  local name=$1 seconds=$2
  shift 2
  local start=$SECONDS
  timeout "$seconds" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  printf '%-8s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - start))" "$(grep -E 'passed|failed|error|tok/s|MFU|TRL|->' "$out/$name.log" | tail -2 | tr '\n' ' ' | cut -c1-300)"
}

for step in $steps; do
  case $step in
    loop) run loop 300 python -m pytest -q -s -rA -m gpu -p no:cacheprovider tests/integration/test_loop_gpu.py \
            tests/integration/test_multiturn_loop.py ;;
    # Episodes in one continuous batch against turn-by-turn resubmission and single-turn sampling.
    multiturn) run multiturn 590 python -m bench.multiturn --out "$out/multiturn.json" ;;
    default) run default 60 python -m colocate.train --config configs/default.yaml \
               --output-dir "$out/default_run" --logging.console False ;;
    engine) run engine 400 python -m pytest -q -s -rA -m gpu -p no:cacheprovider tests/integration/test_engine_gpu.py \
              tests/integration/test_fp8_engine.py ;;
    # Decode at the 4B and 8B shapes: bf16, FP8 weights, FP8 weights and KV cache.
    fp8) run fp8 590 python -m bench.fp8_decode --out "$out/fp8_decode.json" ;;
    e2e) run e2e 590 python -m bench.e2e --steps 3 --warmup 2 --max-tokens-per-gpu 49152 ;;
    # The start-up's sizes (train.max_tokens_per_gpu, the recompute plan and the KV cache all auto)
    # beside hand-picked budgets with nothing recomputed, offload off and on, in one run.
    sizing) run sizing 590 python -m bench.e2e --skip-trl --steps 3 --warmup 2 \
              --max-tokens-per-gpu auto,49152:none,32768:none,16384:none --out "$out/e2e_sizing.json" ;;
    e2e_tail_off) run e2e_tail_off 590 python -m bench.e2e --tail --partial off --steps 2 --warmup 1 \
                    --out "$out/e2e_tail_off.json" ;;
    # Partial rollout reaches its steady state once the first step's 4x groups have drained (about
    # 4 steps): time the steps after 3 warm-up steps.
    e2e_tail_on) run e2e_tail_on 590 python -m bench.e2e --tail --partial on --steps 3 --warmup 3 \
                   --out "$out/e2e_tail_on.json" ;;
    # LoRA rank 64 against full training at the 1.5B shape, then the 8B shape with LoRA alone (the
    # KV cache that remains is what lora_8b reports; at least 40 GiB needs an H200's memory).
    lora) run lora 590 python -m bench.e2e --lora-rank 64 --offload on --skip-trl --steps 6 --warmup 2 \
            --out "$out/e2e_lora.json" ;;
    lora_8b) run lora_8b 590 python -m bench.e2e --shape 8b --lora-rank 64 --lora-only --offload on --skip-trl \
               --steps 1 --warmup 1 --out "$out/e2e_lora_8b.json" ;;
    rollout) run rollout 330 python -m bench.rollout_throughput --profile "$out/rollout_profile.txt" ;;
    prefill) run prefill 300 python -m bench.prefill ;;
    tail) run tail 570 python -m bench.rollout_throughput --cases tail ;;
    colocation) run colocation 150 python -m bench.colocation ;;
    startup) run startup 560 python -m bench.startup ;;
    # Qwen3-4B-shaped start-up (offload on), cold then warm, beside pinning 8 GiB with 1-8 threads.
    startup_4b) run startup_4b 590 python -m bench.startup --cases pinning,qwen3_4b \
                  --out bench/results/startup_4b.json ;;
    on_policy_bits) run on_policy_bits 300 python -m pytest -q -s -rA -m gpu -p no:cacheprovider \
                      tests/unit/test_kernel_batch_invariant.py tests/parity/test_true_on_policy_gpu.py ;;
    on_policy) run on_policy 580 python -m bench.true_on_policy --profile "$out/on_policy_profile.txt" ;;
    train) run train 590 python -m bench.trainer_throughput --models 1.5b --budget-s 560 ;;
    train_small) run train_small 330 python -m bench.trainer_throughput --models 0.5b --budget-s 300 ;;
    kernels) run kernels 60 python -m bench.kernel_bench ;;
    invariant_sweep) run invariant_sweep 300 python -m bench.kernel_bench --invariant-sweep ;;
    units) run units 500 python -m pytest -q -s -rA -m gpu -p no:cacheprovider tests/unit tests/integration/test_trainer_gpu.py \
             tests/integration/test_checkpoint.py tests/integration/test_lora.py tests/integration/test_lora_loop.py ;;
    multigpu) run multigpu 560 python -m pytest -q -s -rA -m multigpu -p no:cacheprovider tests/integration/test_multigpu.py \
                tests/integration/test_checkpoint.py ;;
    *) echo "unknown step $step" >&2 ;;
  esac
done
find bench/results -maxdepth 1 -newer "$marker" \( -name '*.json' -o -name '*.txt' \) -exec cp {} "$out/" \;
rm -f "$marker"
