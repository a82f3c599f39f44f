"""Mutation check of the tests that guard the objective, the settings of the update and of the reward,
resume, the weight sync, the model and the sampler.

Each mutant is a one-line change: (file, an exact fragment of one line, its replacement). For each,
the package and the tests are copied into a temporary directory, the mutant is applied there, and
the test files meant to catch it run against the copy: pytest runs inside the copy with PYTHONPATH
pointing at it, so `import colocate` (in spawned ranks too) loads the mutated code. A mutant is
killed when those tests fail. A fragment that is not found exactly once is an error, so the list
has to follow the code. The unmutated copy runs every test file once first: a failure there would
make every kill meaningless.

Prints killed/survived per mutant and a summary line; writes bench/results/mutants.json; exits 1
if a mutant survived. About 30 minutes on 2 CPU cores; run by hand:
    python -m tools.mutants [--only NAME ...] [--no-baseline]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "mutants.json"
COPIED = ("colocate", "tests", "configs", "pyproject.toml")
TIMEOUT_S = 600

OBJECTIVE = ("tests/integration/test_objective_terms.py",)
RESUME = ("tests/integration/test_resume_state.py",)
SYNC = tuple(
    f"tests/integration/test_weight_sync.py::{name}"
    for name in (
        "test_fsdp_sync_hands_over_every_full_tensor_in_engine_dtype",
        "test_one_rank_hands_over_masters_to_a_casting_engine",
        "test_every_native_engine_parameter_holds_the_cast_master",
    )
)
LOGITS = ("tests/parity/test_models.py::test_logits_match_transformers",)
LORA_CRITIC = tuple(
    f"tests/integration/test_lora.py::{name}"
    for name in (
        "test_critic_trains_adapters_and_value_head_on_a_frozen_base",
        "test_critic_checkpoint_holds_its_adapters_and_head_and_resumes_exactly",
    )
)
PARTIAL = (
    "tests/unit/test_partial_rollout.py",
    "tests/integration/test_partial_rollout.py::test_a_run_never_exceeds_the_staleness_bound_nor_restarts",
)
LORA_GRADIENTS = ("tests/unit/test_lora.py::test_forward_and_gradients_match_the_merged_weights",)
LORA_RECOMPUTE = ("tests/unit/test_checkpointing.py::test_lora_blocks_never_keep_a_merged_weight",)
DROPOUT_COMPILE = (
    "tests/unit/test_checkpointing.py::test_recomputed_blocks_with_dropout_run_uncompiled_where_torch_cannot_compile_them",
)
ROTARY_LAYOUT = ("tests/unit/test_kernel_rotary.py::test_cpu_op_gives_contiguous_outputs_for_permuted_inputs",)
ON_POLICY_LORA = ("tests/parity/test_true_on_policy.py::test_a_lora_run_in_the_mode_logs_no_mismatch_after_its_adapters_moved",)
INVARIANT_OPS = ("tests/unit/test_invariant_ops.py",)
SAMPLER = (
    "tests/parity/test_engine_parity.py::test_sampler_truncation_keeps_the_expected_tokens",
    "tests/parity/test_engine_parity.py::test_truncation_to_one_token_equals_greedy",
)
MISMATCH = ("tests/unit/test_mismatch.py",)
ADVANTAGES = ("tests/unit/test_advantages.py",)
LORA_MERGE = ("tests/integration/test_lora.py::test_pushed_weights_are_peft_merges_and_later_pushes_send_adapted_modules_only",)
LORA_MERGE_KERNEL = ("tests/unit/test_kernels_interpreted.py::test_lora_merge_kernel_matches_the_torch_merge",)
LORA_MERGE_ROUNDINGS = ("tests/unit/test_kernels_compile.py::test_the_lora_merge_multiplies_on_the_tensor_cores",)
LORA_MERGE_GRAPH = ("tests/unit/test_kernels_compile.py::test_a_compiled_graph_launches_the_lora_merge_kernel_itself",)
LORA_KEPT = ("tests/integration/test_lora.py::test_step_zero_is_the_base_model_and_only_adapters_train",)
STALE_MASK = ("tests/unit/test_partial_rollout.py::test_stale_tokens_leave_the_mask_only_when_asked",)
LOSS_FREE = (
    "tests/unit/test_packing.py::test_steps_leave_out_samples_with_no_token_in_the_loss",
    "tests/integration/test_partial_stale_mask.py::test_samples_with_every_token_stale_are_not_run_and_the_update_is_unchanged",
)
DECODE_ORDER = ("tests/unit/test_scheduler.py::test_decode_rows_go_longest_context_first",)
PARTIAL_RESUME = (
    "tests/unit/test_partial_rollout.py::test_group_state_round_trips_through_json",
    "tests/integration/test_partial_loop.py::test_resume_continues_carried_samples_and_every_group_trains_once",
)
INTERPRETED = "tests/unit/test_kernels_interpreted.py::"
SPLIT_KV = (INTERPRETED + "test_paged_decode_kernel_matches_the_reference",)
K_CHUNKS = (INTERPRETED + "test_invariant_matmul_sums_k_chunks_alike_in_one_program_or_one_per_chunk",)
TILE_PICK = (INTERPRETED + "test_invariant_matmul_picks_the_largest_tile_that_fills_the_device",)
INVARIANT_ATTENTION = (INTERPRETED + "test_invariant_attention_packed_prefill_and_decode_agree",)
INVARIANT_ROWS = (
    INTERPRETED + "test_invariant_row_reductions_match_torch",
    INTERPRETED + "test_the_modes_sampler_subtracts_the_trainers_log_sum_exp_bit_for_bit",
)
LEDGER = ("tests/unit/test_memory_ledger.py",)
MANAGER = "tests/integration/test_rollout_manager.py::"
FALLBACK = "tests/integration/test_checkpoint_fallback.py::"
LOSSES_TESTS = ("tests/unit/test_losses.py",)
OBJECTIVE_CASES = ("tests/integration/test_objective_terms.py::test_trainer_follows_the_documented_objective",)
SETTINGS = ("tests/integration/test_objective_terms.py::test_trainer_follows_the_optimizer_and_mis_settings",)
SEQUENCE_LOSSES = ("tests/integration/test_objective_terms.py::test_trainer_follows_the_gspo_and_cispo_objectives",)
ADAMW = ("tests/unit/test_optim.py::test_steps_match_torch_adamw_under_every_setting",)
ESTIMATORS = ("tests/integration/test_trainer_fsdp.py::test_advantages_match_the_algo_estimators",)
GROUP_ADVANTAGES = ("tests/integration/test_trainer_fsdp.py::test_group_advantages_follow_normalize_advantage_std_and_dr_grpo",)
CRITIC_FIRST = ("tests/integration/test_trainer_fsdp.py::test_critic_trains_first_and_its_value_loss_decreases",)
OVERLONG = ("tests/integration/test_rollout_manager.py::test_a_runs_rollouts_carry_the_configured_overlong_penalty",)


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]


ACTOR, LOSSES, CKPT = "colocate/trainer/actor.py", "colocate/algo/losses.py", "colocate/checkpoint.py"
OPTIM, CRITIC = "colocate/trainer/optim.py", "colocate/trainer/critic.py"
GLOBAL_ADVANTAGES = "colocate/trainer/global_advantages.py"
TRAINER, SYNC_FILE = "colocate/trainer/trainer.py", "colocate/colocation/weight_sync.py"
ENGINE = "colocate/rollout/native/engine.py"
FP8_ENGINE = ("tests/integration/test_fp8_engine.py",)
PG_LOSS = "loss = agg(pg_tok, mask,"
ACTOR_STATE = "ModelOptimizerState(self.actor.model, opt.optimizer, opt.scheduler,"
CRITIC_STATE = "self.critic.model, c.optimizer, c.scheduler, adapters="
KL_TERM = "a.kl_estimator),\n                loss_mask,"
WHOLE_TENSORS = "tensors = _unit_tensors(unit, _whole(unit), dtype, not engine_casts, since_last)"
GATHERED_TENSORS = "tensors = _unit_tensors(unit, _gathered(unit), dtype, True, since_last)"

MUTANTS = [
    Mutant("pg_loss_zeroed", ACTOR, PG_LOSS, "loss = 0.0 * agg(pg_tok, mask,", OBJECTIVE),
    Mutant("pg_loss_sign", ACTOR, PG_LOSS, "loss = -agg(pg_tok, mask,", OBJECTIVE),
    Mutant("kl_loss_zeroed", ACTOR, "loss = loss + a.kl_loss_coef * kl", "loss = loss + 0.0 * a.kl_loss_coef * kl", OBJECTIVE),
    Mutant("kl_loss_sign", ACTOR, "loss = loss + a.kl_loss_coef * kl", "loss = loss - a.kl_loss_coef * kl", OBJECTIVE),
    Mutant(
        "kl_in_reward_zeroed",
        "colocate/trainer/global_advantages.py",
        "coef = algo.kl_reward_coef if kl is not None else 0.0",
        "coef = 0.0",
        OBJECTIVE,
    ),
    Mutant("entropy_zeroed", ACTOR, "loss = loss - a.entropy_coef * ent", "loss = loss - 0.0 * a.entropy_coef * ent", OBJECTIVE),
    Mutant("entropy_sign", ACTOR, "loss = loss - a.entropy_coef * ent", "loss = loss + a.entropy_coef * ent", OBJECTIVE),
    Mutant(
        "entropy_ignores_mis",
        ACTOR,
        "ent = agg(entropy if a.entropy_coef else entropy.detach(), loss_mask,",
        "ent = agg(entropy if a.entropy_coef else entropy.detach(), mask,",
        OBJECTIVE,
    ),
    Mutant("kl_loss_ignores_mis", ACTOR, KL_TERM, "a.kl_estimator),\n                mask,", OBJECTIVE),
    Mutant("tis_weights_not_applied", ACTOR, "tis_weights=tis,", "tis_weights=None,", OBJECTIVE),
    Mutant(
        "tis_weights_inverted",
        LOSSES,
        "old_logprobs - rollout_logprobs, 0.0))",
        "rollout_logprobs - old_logprobs, 0.0))",
        OBJECTIVE,
    ),
    Mutant("tis_truncation_off", LOSSES, "weights = ratio.clamp(max=clip) * m", "weights = ratio * m", OBJECTIVE),
    Mutant("mis_mask_off", LOSSES, "return kept * m, {", "return m, {", OBJECTIVE),
    Mutant(
        "mis_mask_not_applied",
        ACTOR,
        'batch["advantages"][idx],\n            loss_mask,',
        'batch["advantages"][idx],\n            mask,',
        OBJECTIVE,
    ),
    Mutant("ppo_clip_off", LOSSES, "loss = torch.maximum(unclipped, clipped_obj)", "loss = unclipped", OBJECTIVE),
    Mutant(
        "clip_higher_off",
        LOSSES,
        "eps_high = eps_clip if eps_clip_high is None else eps_clip_high",
        "eps_high = eps_clip",
        OBJECTIVE,
    ),
    Mutant("dual_clip_off", LOSSES, "loss = torch.where(capped, cap, loss)", "loss = loss", OBJECTIVE),
    Mutant("dual_clip_sign", LOSSES, "cap = -dual_clip_c * advantages", "cap = dual_clip_c * advantages", OBJECTIVE),
    Mutant("value_clip_off", LOSSES, "loss = 0.5 * torch.maximum(unclipped, clipped)", "loss = 0.5 * unclipped", OBJECTIVE),
    Mutant(
        "value_clip_optimistic",
        LOSSES,
        "loss = 0.5 * torch.maximum(unclipped, clipped)",
        "loss = 0.5 * torch.minimum(unclipped, clipped)",
        OBJECTIVE,
    ),
    Mutant("checkpoint_drops_actor_optimizer", TRAINER, ACTOR_STATE, "ModelOptimizerState(self.actor.model,", RESUME),
    Mutant(
        "checkpoint_drops_actor_scheduler", TRAINER, ACTOR_STATE, "ModelOptimizerState(self.actor.model, opt.optimizer,", RESUME
    ),
    Mutant("checkpoint_drops_critic_optimizer", TRAINER, CRITIC_STATE, "self.critic.model, adapters=", RESUME),
    Mutant("checkpoint_drops_critic_scheduler", TRAINER, CRITIC_STATE, "self.critic.model, c.optimizer, adapters=", RESUME),
    Mutant(
        "checkpoint_keeps_lora_critic_whole",
        TRAINER,
        "adapters=describe(m.critic_path or m.path)",
        "adapters=None",
        LORA_CRITIC,
    ),
    Mutant(
        "lora_critic_value_head_frozen",
        "colocate/trainer/critic.py",
        "model.value_head.to(torch.float32).requires_grad_(True)",
        "model.value_head.to(torch.float32).requires_grad_(False)",
        LORA_CRITIC,
    ),
    Mutant(
        "partial_never_held_for_staleness",
        "colocate/rollout/orchestrator.py",
        "ok = schedulable([stale[id(g)] for g in carried], target, c.max_staleness)",
        "ok = True",
        PARTIAL,
    ),
    Mutant(
        "partial_schedule_ignores_later_steps",
        "colocate/rollout/partial.py",
        "return all(s + i // per_step + 1 <= max_staleness",
        "return all(s + 1 <= max_staleness",
        PARTIAL,
    ),
    Mutant(
        "resume_drops_data_sampler",
        "colocate/train.py",
        'self.inputs.data.load_state_dict(extra["data"])',
        "self.inputs.data.state_dict()",
        RESUME,
    ),
    Mutant(
        "resume_drops_rng",
        CKPT,
        "_set_rng_state(torch.load(rng_file, weights_only=True))",
        "torch.load(rng_file, weights_only=True)",
        RESUME,
    ),
    Mutant(
        "sync_skips_a_root_parameter",
        SYNC_FILE,
        "([(model, root)] if root else [])",
        "([(model, root[:-1])] if root else [])",
        SYNC,
    ),
    Mutant(
        "sync_skips_a_whole_unit_parameter",
        SYNC_FILE,
        WHOLE_TENSORS,
        f"tensors = (t for i, t in enumerate({WHOLE_TENSORS[len('tensors = ') :]}) if i)",
        SYNC,
    ),
    Mutant(
        "sync_skips_a_gathered_parameter",
        SYNC_FILE,
        GATHERED_TENSORS,
        f"tensors = (t for i, t in enumerate({GATHERED_TENSORS[len('tensors = ') :]}) if i)",
        SYNC,
    ),
    Mutant("rope_theta_doubled", "colocate/models/layers.py", "inv = 1.0 / (theta **", "inv = 1.0 / ((2 * theta) **", LOGITS),
    Mutant(
        "rope_llama3_wavelength", "colocate/models/layers.py", "wavelen = 2 * math.pi / inv", "wavelen = math.pi / inv", LOGITS
    ),
    Mutant(
        "on_policy_lora_adds_its_terms_beside_the_base",
        "colocate/trainer/lora.py",
        "if self.dropout and self.training and torch.is_grad_enabled() and not self.ops.invariant:",
        "if True:",
        ON_POLICY_LORA,
    ),
    Mutant(
        "lora_input_gradient_skips_the_adapters",
        "colocate/trainer/lora.py",
        "grad_x = torch.addmm(flat_grad @ _joined(weights), grad_low, downs)",
        "grad_x = flat_grad @ _joined(weights)",
        LORA_GRADIENTS,
    ),
    Mutant(
        "lora_dropout_path_drops_the_scale",
        "colocate/trainer/lora.py",
        "return F.linear(F.linear(x, self.lora_A.weight) * self.scale, self.lora_B.weight)",
        "return F.linear(F.linear(x, self.lora_A.weight), self.lora_B.weight)",
        LORA_GRADIENTS,
    ),
    Mutant(
        "lora_merge_kept_for_backward_by_selective_plans",
        "colocate/trainer/parallelize.py",
        "and shape[1] != recompute_width and shape[0] != low_rank)",
        "and shape[1] != recompute_width)",
        LORA_RECOMPUTE,
    ),
    Mutant(
        "recomputed_dropout_blocks_compiled_where_torch_cannot",
        "colocate/trainer/parallelize.py",
        "return [compile and not (eager and mode != \"none\") for mode in modes]",
        "return [compile for mode in modes]",
        DROPOUT_COMPILE,
    ),
    Mutant(
        "rotary_cpu_op_keeps_a_permuted_layout",
        "colocate/kernels/rotary.py",
        "return reference_rotate(q, cos, sin).contiguous(), reference_rotate(k, cos, sin).contiguous()",
        "return reference_rotate(q, cos, sin), reference_rotate(k, cos, sin)",
        ROTARY_LAYOUT,
    ),
    Mutant(
        "invariant_rms_norm_backward_drops_the_mean_term",
        "colocate/kernels/invariant_ops.py",
        "return r * grad_n - xf * r.pow(3) * (grad_n * xf).mean(-1, keepdim=True), grad_w",
        "return r * grad_n, grad_w",
        INVARIANT_OPS,
    ),
    Mutant(
        "invariant_add_rms_norm_backward_drops_the_stream",
        "colocate/kernels/invariant_ops.py",
        "grad_x = grad_x + grad_total.float()",
        "grad_x = grad_x",
        INVARIANT_OPS,
    ),
    Mutant(
        "invariant_silu_mul_backward_forgets_the_gate",
        "colocate/kernels/invariant_ops.py",
        "return grad_gate.to(gate.dtype), (gradf * gf * s).to(up.dtype)",
        "return grad_gate.to(gate.dtype), (gradf * s).to(up.dtype)",
        INVARIANT_OPS,
    ),
    Mutant(
        "invariant_linear_backward_transposes_the_weight_gradient",
        "colocate/kernels/invariant_ops.py",
        "grad_w = flat.T @ x.reshape(-1, x.shape[-1]) if need[1] else None",
        "grad_w = (flat.T @ x.reshape(-1, x.shape[-1])).flip(0) if need[1] else None",
        INVARIANT_OPS,
    ),
    Mutant("top_p_cut_off", "colocate/rollout/native/sampler.py", "& (top_p < 1)[:, None])", "& (top_p < 0)[:, None])", SAMPLER),
    Mutant(
        "top_p_never_truncates", "colocate/rollout/native/sampler.py", "truncate=any(p.top_p < 1 or ", "truncate=any(", SAMPLER
    ),
    Mutant(
        "mismatch_kl_k3_is_k1", ACTOR, 'agg(kl_estimate(rollout, train, "k3")', 'agg(kl_estimate(rollout, train, "k1")', MISMATCH
    ),
    Mutant(
        "mismatch_nonzero_frac_inverted", ACTOR, "agg((delta != 0).to(mask.dtype)", "agg((delta == 0).to(mask.dtype)", MISMATCH
    ),
    Mutant(
        "grpo_std_biased",
        "colocate/algo/advantages.py",
        "centered / (grouped.std(dim=1, keepdim=True) + eps)",
        "centered / (grouped.std(dim=1, keepdim=True, correction=0) + eps)",
        ADVANTAGES,
    ),
    Mutant(
        "rloo_baseline_includes_self",
        "colocate/algo/advantages.py",
        "others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)",
        "others_mean = grouped.mean(dim=1, keepdim=True)",
        ADVANTAGES,
    ),
    Mutant(
        "dapo_overlong_penalty_from_the_cap",
        "colocate/algo/advantages.py",
        "excess = response_lengths.float() - (max_response_len - buffer_len)",
        "excess = response_lengths.float() - max_response_len",
        ADVANTAGES,
    ),
    Mutant(
        "lora_merge_drops_the_scale",
        "colocate/lora/merge.py",
        "merged.mul_(scale).add_(weight)",
        "merged.add_(weight)",
        LORA_MERGE,
    ),
    Mutant(
        "lora_merge_kernel_drops_the_scale",
        "colocate/kernels/lora_merge.py",
        "scaled = acc * scale\n",
        "scaled = acc\n",
        LORA_MERGE_KERNEL,
    ),
    Mutant(
        "lora_merge_kernel_fuses_the_scale_and_the_add",
        "colocate/kernels/lora_merge.py",
        '"mul.rn.f32 $0, $1, $2;"',
        '"mul.f32 $0, $1, $2;"',
        LORA_MERGE_ROUNDINGS,
    ),
    Mutant(
        "lora_merge_an_opaque_op_in_compiled_graphs",
        "colocate/kernels/lora_merge.py",
        "@torch.library.triton_op(",
        "@torch.library.custom_op(",
        LORA_MERGE_GRAPH,
    ),
    Mutant(
        "lora_adapters_leave_with_the_base",
        "colocate/trainer/memory.py",
        "self.offloader.register(tag, frozen if keep_trained else model.parameters,",
        "self.offloader.register(tag, model.parameters,",
        LORA_KEPT,
    ),
    Mutant(
        "stale_mask_keeps_one_version_more", "colocate/trainer/batch.py", ">= stale_before", ">= stale_before - 1", STALE_MASK
    ),
    Mutant(
        "skipped_samples_leave_the_sequence_count",
        "colocate/trainer/passes.py",
        "len(sl), len(sl) - len(trained)]",
        "len(trained), len(sl) - len(trained)]",
        LOSS_FREE,
    ),
    Mutant(
        "samples_with_a_stale_first_token_are_skipped",
        "colocate/trainer/passes.py",
        "if batch.mask_sums[i] > 0]",
        "if batch.mask_sums[i] > 0 and batch.mask[batch.response_offsets[i]] > 0]",
        LOSS_FREE,
    ),
    Mutant(
        "decode_rows_in_admission_order",
        "colocate/rollout/native/scheduler.py",
        "batch.seqs.sort(key=lambda s: s.num_tokens, reverse=True)",
        "batch.seqs.sort(key=lambda s: 0)",
        DECODE_ORDER,
    ),
    Mutant(
        "partial_checkpoint_drops_token_versions",
        "colocate/rollout/partial.py",
        '"rollout_logprobs",\n    "token_versions",',
        '"rollout_logprobs",',
        PARTIAL_RESUME,
    ),
    Mutant(
        "split_kv_merge_unweighted",
        "colocate/kernels/paged_attention_triton.py",
        "out = tl.sum(part * weight[:, None], axis=0)",
        "out = tl.sum(part, axis=0)",
        SPLIT_KV,
    ),
    Mutant(
        "invariant_matmul_drops_the_last_chunk",
        "colocate/kernels/batch_invariant_cuda.py",
        "for _ in range(1, chunks):",
        "for _ in range(2, chunks):",
        K_CHUNKS,
    ),
    Mutant(
        "invariant_attention_denominator_not_rescaled",
        "colocate/kernels/invariant_attention.py",
        "l_acc = tl.dot(p, ones, l_acc * alpha[:, None]",
        "l_acc = tl.dot(p, ones, l_acc",
        INVARIANT_ATTENTION,
    ),
    Mutant(
        "invariant_entropy_drops_the_log_sum",
        "colocate/kernels/sampling.py",
        "tl.log(total) - tl.sum(weight * (t + (m - top) * s), axis=0) / total",
        "-tl.sum(weight * (t + (m - top) * s), axis=0) / total",
        INVARIANT_ROWS,
    ),
    Mutant(
        "invariant_entropy_slices_not_shifted_to_the_row_max",
        "colocate/kernels/sampling.py",
        "tl.sum(weight * (t + (m - top) * s), axis=0)",
        "tl.sum(weight * t, axis=0)",
        INVARIANT_ROWS,
    ),
    Mutant(
        "invariant_entropy_blocks_not_shifted_to_the_new_max",
        "colocate/kernels/sampling.py",
        "t = (t + (m - m_new) * s) * rescale",
        "t = t * rescale",
        INVARIANT_ROWS,
    ),
    Mutant(
        "tile_pick_ignores_the_wide_tiles_rule",
        "colocate/kernels/batch_invariant_cuda.py",
        "if not tile[4] or (chunks == 1 and n >= WIDE_N)]",
        "]",
        TILE_PICK,
    ),
    Mutant(
        "tile_pick_splits_whatever_the_walk_saved",
        "colocate/kernels/batch_invariant_cuda.py",
        "split = k >= SPLIT_GAIN * K_CHUNK and",
        "split = chunks > 1 and",
        TILE_PICK,
    ),
    Mutant(
        "alloc_retries_since_start_not_per_step",
        "colocate/colocation/ledger.py",
        "new, first = retries - self._retries,",
        "new, first = retries,",
        LEDGER,
    ),
    Mutant("oom_advice_never_names_recompute", "colocate/colocation/ledger.py", "if full < 1:", "if full < 0:", LEDGER),
    Mutant(
        "phase_oom_left_as_it_is",
        "colocate/train.py",
        "except torch.OutOfMemoryError as e:",
        "except KeyboardInterrupt as e:",
        LEDGER,
    ),
    Mutant(
        "eval_pass_needs_every_sample",
        "colocate/rollout/orchestrator.py",
        "sum(max(r) >= 1.0 for r in rewards)",
        "sum(min(r) >= 1.0 for r in rewards)",
        (MANAGER + "test_evaluate_averages_rewards_and_counts_prompts_with_a_success",),
    ),
    Mutant(
        "dynamic_sampling_keeps_uniform_groups",
        "colocate/rollout/orchestrator.py",
        "varied = len({round(s.reward, 6) for s in g}) > 1",
        "varied = len({round(s.reward, 6) for s in g}) > 0",
        (MANAGER + "test_dynamic_sampling_drops_uniform_groups_and_tops_up",),
    ),
    Mutant(
        "checkpoint_sizes_unchecked",
        "colocate/checkpoint_manifest.py",
        'if size != saved["size"]:',
        "if False:",
        (FALLBACK + "test_a_truncated_file_in_the_newest_checkpoint_falls_back_to_the_previous_one",),
    ),
    Mutant(
        "pruning_counts_damaged_checkpoints",
        CKPT,
        "elif checkpoint_problem(path) is None:",
        "else:",
        (FALLBACK + "test_pruning_does_not_count_a_damaged_checkpoint_among_those_kept",),
    ),
    Mutant(
        "seq_mean_token_mean_sums_tokens",
        LOSSES,
        "return (seq_sum / seq_len).sum() / global_num_seqs",
        "return seq_sum.sum() / global_num_seqs",
        LOSSES_TESTS,
    ),
    Mutant(
        "top_k_keeps_one_more",
        "colocate/rollout/native/sampler.py",
        "rank[None, :] >= top_k[:, None]",
        "rank[None, :] > top_k[:, None]",
        SAMPLER,
    ),
    Mutant(
        "preemption_keeps_the_computed_count",
        "colocate/rollout/native/scheduler.py",
        "        seq.num_computed = 0\n        self.waiting.appendleft([seq])",
        "        self.waiting.appendleft([seq])",
        (
            "tests/unit/test_scheduler.py::test_preemption_frees_blocks_and_recomputes_with_identical_results",
            "tests/parity/test_engine_parity.py::test_preemption_gives_the_same_outputs",
        ),
    ),
    Mutant(
        "preemption_leaves_admission_greedy",
        "colocate/rollout/native/scheduler.py",
        "        self.reserve = 1.0",
        "        self.reserve = 0.0",
        ("tests/unit/test_scheduler.py::test_admission_backs_off_after_a_preemption",),
    ),
    Mutant(
        "pinned_piece_not_a_power_of_two",
        "colocate/trainer/offload.py",
        "    capacity = 1 << (capacity - 1).bit_length()\n",
        "",
        ("tests/unit/test_offload_layout.py",),
    ),
    Mutant(
        "first_offload_copies_zeros",
        "colocate/trainer/offload.py",
        "zeros = self._zero_storages(todo) if self.fresh else set()",
        "zeros = set()",
        ("tests/unit/test_first_offload.py",),
    ),
    Mutant(
        "first_offload_waits_for_pinning",
        "colocate/trainer/offload.py",
        "self._slot(i, standin=self.fresh).copy_(",
        "self._slot(i).copy_(",
        ("tests/unit/test_first_offload.py",),
    ),
    Mutant(
        "stand_in_kept_out_of_its_pinned_piece",
        "colocate/trainer/offload.py",
        "                self.kept |= kept_later[piece]",
        "                pass",
        ("tests/unit/test_first_offload.py",),
    ),
    Mutant(
        "streamed_block_skips_the_prefetched_next",
        "colocate/trainer/memory.py",
        "through[min(i + 1, last)]",
        "through[i]",
        ("tests/unit/test_param_arrival.py",),
    ),
    Mutant(
        "streamed_root_not_waited_for",
        "colocate/trainer/memory.py",
        "                events[0].synchronize()",
        "                pass",
        ("tests/unit/test_param_arrival.py",),
    ),
    Mutant(
        "qwen2_tokenizer_loaded_as_generic",
        "colocate/models/config.py",
        'GENERIC_TOKENIZER_MODEL_TYPES = ("llama", "qwen3")',
        'GENERIC_TOKENIZER_MODEL_TYPES = ("llama", "qwen2", "qwen3")',
        ("tests/unit/test_toy.py",),
    ),
    Mutant(
        "decode_batch_not_marked_dynamic",
        "colocate/rollout/native/model_runner.py",
        "                torch._dynamo.maybe_mark_dynamic(t, 0)\n",
        "                pass\n",
        ("tests/parity/test_engine_parity.py::test_compiled_decode_equals_eager_decode",),
    ),
    Mutant(
        "compiled_prefill_drops_the_cached_prefix",
        "colocate/rollout/native/model_runner.py",
        "ctx.gather_slots,\n                self.scale,\n            )\n        return inner.norm(x)",
        "None,\n                self.scale,\n            )\n        return inner.norm(x)",
        ("tests/parity/test_engine_parity.py::test_compiled_decode_equals_eager_decode",),
    ),
    Mutant(
        "prefill_of_the_threshold_stays_eager",
        "colocate/rollout/native/model_runner.py",
        "len(ids) >= self.compiled_prefill_min_tokens",
        "len(ids) > self.compiled_prefill_min_tokens",
        ("tests/parity/test_engine_parity.py::test_only_prefills_of_the_threshold_run_compiled",),
    ),
    # Settings disconnected where they are read: the value is replaced by the field's default (or
    # its effect dropped), so a test must compare the update or the reward with a formula.
    Mutant(
        "lr_disconnected",
        TRAINER,
        "self._optimizer(actor_model, t.lr, ACTOR_OPTIM,",
        "self._optimizer(actor_model, 5e-3, ACTOR_OPTIM,",
        OBJECTIVE_CASES,
    ),
    Mutant(
        "critic_lr_is_the_actors",
        TRAINER,
        "critic_model, t.critic_lr, CRITIC_OPTIM,",
        "critic_model, t.lr, CRITIC_OPTIM,",
        SETTINGS,
    ),
    Mutant(
        "lr_schedule_disconnected",
        TRAINER,
        "LRSchedule(t.lr_schedule, t.lr_warmup_steps,",
        'LRSchedule("constant", t.lr_warmup_steps,',
        SETTINGS,
    ),
    Mutant("lr_warmup_steps_disconnected", TRAINER, "t.lr_warmup_steps, total_steps,", "0, total_steps,", OBJECTIVE_CASES),
    Mutant("min_lr_ratio_disconnected", TRAINER, "total_steps, t.min_lr_ratio)", "total_steps, 0.0)", SETTINGS),
    Mutant("adam_beta1_disconnected", TRAINER, "betas=(t.adam_beta1, t.adam_beta2)", "betas=(0.9, t.adam_beta2)", SETTINGS),
    Mutant("adam_beta2_disconnected", TRAINER, "betas=(t.adam_beta1, t.adam_beta2)", "betas=(t.adam_beta1, 0.999)", SETTINGS),
    Mutant("adam_eps_disconnected", TRAINER, "eps=t.adam_eps,", "eps=1e-8,", OBJECTIVE_CASES),
    Mutant("weight_decay_disconnected", TRAINER, "weight_decay=t.weight_decay,", "weight_decay=0.0,", OBJECTIVE_CASES),
    Mutant("grad_clip_disconnected", TRAINER, "grad_clip=t.grad_clip,", "grad_clip=None,", SETTINGS),
    Mutant("adamw_default_betas", OPTIM, "lr=lr, betas=betas, eps=eps, fused", "lr=lr, eps=eps, fused", ADAMW),
    Mutant("adamw_default_eps", OPTIM, "lr=lr, betas=betas, eps=eps, fused", "lr=lr, betas=betas, fused", ADAMW),
    Mutant(
        "matrices_not_decayed",
        OPTIM,
        '{"params": decay, "weight_decay": weight_decay}',
        '{"params": decay, "weight_decay": 0.0}',
        ADAMW,
    ),
    Mutant(
        "optimizer_step_never_clips",
        OPTIM,
        "clip_grad_norm(self.params, self.grad_clip)",
        "clip_grad_norm(self.params, None)",
        ADAMW,
    ),
    Mutant("policy_loss_disconnected", ACTOR, "kind=a.policy_loss,", 'kind="ppo",', SEQUENCE_LOSSES),
    Mutant("eps_clip_disconnected", ACTOR, "eps_clip=a.eps_clip,", "eps_clip=0.2,", OBJECTIVE_CASES),
    Mutant("eps_clip_high_disconnected", ACTOR, "eps_clip_high=a.eps_clip_high,", "eps_clip_high=None,", OBJECTIVE_CASES),
    Mutant("dual_clip_c_disconnected", ACTOR, "dual_clip_c=a.dual_clip_c,", "dual_clip_c=None,", OBJECTIVE_CASES),
    Mutant(
        "loss_agg_mode_disconnected",
        ACTOR,
        "loss = agg(pg_tok, mask, mode=a.loss_agg_mode,",
        'loss = agg(pg_tok, mask, mode="token_mean",',
        OBJECTIVE_CASES,
    ),
    Mutant(
        "critic_loss_agg_mode_disconnected",
        CRITIC,
        "agg(loss_tok, mode=self.algo.loss_agg_mode,",
        'agg(loss_tok, mode="token_mean",',
        SETTINGS,
    ),
    Mutant(
        "kl_estimator_disconnected_in_the_loss",
        ACTOR,
        KL_TERM,
        '"low_var_kl"),\n                loss_mask,',
        OBJECTIVE_CASES,
    ),
    Mutant(
        "kl_estimator_disconnected_in_the_reward",
        GLOBAL_ADVANTAGES,
        'batch["ref_logprobs"], algo.kl_estimator)',
        'batch["ref_logprobs"], "low_var_kl")',
        OBJECTIVE_CASES,
    ),
    Mutant("tis_clip_disconnected", ACTOR, "mask, a.tis_clip)", "mask, 2.0)", OBJECTIVE_CASES),
    Mutant("mis_low_disconnected", ACTOR, "a.mis_low, a.mis_high)", "0.5, a.mis_high)", SETTINGS),
    Mutant("mis_high_disconnected", ACTOR, "a.mis_low, a.mis_high)", "a.mis_low, 2.0)", SETTINGS),
    Mutant("value_clip_disconnected", CRITIC, "self.algo.value_clip)", "0.2)", OBJECTIVE_CASES),
    Mutant(
        "num_critic_only_steps_disconnected", TRAINER, "rollout_id < a.num_critic_only_steps)", "rollout_id < 0)", CRITIC_FIRST
    ),
    Mutant(
        "group_size_disconnected",
        TRAINER,
        "compute_advantages(batch, a, cfg.rollout.n_samples_per_prompt)",
        "compute_advantages(batch, a, 8)",
        OBJECTIVE_CASES,
    ),
    Mutant(
        "normalize_advantage_std_disconnected",
        GLOBAL_ADVANTAGES,
        "normalize_std=algo.normalize_advantage_std)",
        "normalize_std=True)",
        GROUP_ADVANTAGES,
    ),
    Mutant(
        "dr_grpo_runs_grpo",
        GLOBAL_ADVANTAGES,
        "seq_adv = dr_grpo(rewards, group_size)",
        "seq_adv = grpo(rewards, group_size)",
        GROUP_ADVANTAGES,
    ),
    Mutant("gae_gamma_disconnected", GLOBAL_ADVANTAGES, "algo.gamma, algo.lam)", "1.0, algo.lam)", ESTIMATORS),
    Mutant("gae_lam_disconnected", GLOBAL_ADVANTAGES, "algo.gamma, algo.lam)", "algo.gamma, 0.95)", ESTIMATORS),
    Mutant("reinforce_gamma_disconnected", GLOBAL_ADVANTAGES, "gamma = algo.gamma", "gamma = 1.0", ESTIMATORS),
    Mutant(
        "overlong_off_in_the_inputs",
        "colocate/inputs.py",
        "overlong = (a.overlong_buffer_len, a.overlong_penalty_factor) if a.overlong_buffer_len else None",
        "overlong = None",
        OVERLONG,
    ),
    Mutant(
        "overlong_penalty_factor_disconnected",
        "colocate/inputs.py",
        "(a.overlong_buffer_len, a.overlong_penalty_factor)",
        "(a.overlong_buffer_len, 1.0)",
        OVERLONG,
    ),
    Mutant(
        "overlong_not_handed_to_the_rollouts", "colocate/train.py", "overlong=self.inputs.overlong,", "overlong=None,", OVERLONG
    ),
    Mutant(
        "overlong_ignores_max_response_len",
        "colocate/rollout/orchestrator.py",
        "dapo_overlong_penalty(lengths, self.cfg.max_response_len,",
        "dapo_overlong_penalty(lengths, 8,",
        OVERLONG,
    ),
    # FP8 rollout (rollout.weight_dtype, rollout.kv_cache_dtype) and the TIS default it turns on.
    Mutant("fp8_weights_not_quantized", ENGINE, "if self.fp8_weights:", "if False:", FP8_ENGINE),
    Mutant("fp8_updates_copied_unquantized", ENGINE, "if name in scales:", "if False:", FP8_ENGINE),
    Mutant(
        "kv_cache_dtype_disconnected",
        ENGINE,
        'kv_dtype = E4M3 if kv_cache_dtype == "fp8_e4m3" else compute_dtype',
        "kv_dtype = compute_dtype",
        FP8_ENGINE,
    ),
    Mutant(
        "tis_default_ignores_fp8",
        "colocate/config.py",
        "return self.rollout.fp8 if self.algorithm.use_tis is None",
        "return False if self.algorithm.use_tis is None",
        ("tests/unit/test_config.py::test_a_bool_or_none_field_is_a_flag_too", *FP8_ENGINE),
    ),
    Mutant("resolved_tis_not_handed_to_the_actor", TRAINER, "use_tis=cfg.tis_on,", "use_tis=False,", OBJECTIVE),
    Mutant(
        "fp8_prefill_attends_its_new_keys_rounded",
        "colocate/rollout/native/attention_ops.py",
        "        if scales:  # the new keys as computed",
        "        if False:  # the new keys as computed",
        FP8_ENGINE,
    ),
]


def check_fragments(mutants: list[Mutant]) -> None:
    """Every fragment occurs exactly once in its file of the working tree (else the list is stale)."""
    problems = []
    for m in mutants:
        count = (ROOT / m.file).read_text().count(m.original)
        if count != 1:
            problems.append(f"{m.name}: {m.original!r} found {count} times in {m.file}")
    names = [m.name for m in mutants]
    problems += [f"{n}: listed twice" for n in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise SystemExit("error: the mutant list does not match the code:\n  " + "\n  ".join(problems))


def copy_tree(dest: pathlib.Path) -> None:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(src, dest / name)


def run_tests(tree: pathlib.Path, tests: tuple[str, ...]) -> tuple[int, float, str]:
    """(pytest exit code, seconds, the first failing test or the last output line)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, time.perf_counter() - start, f"timed out after {TIMEOUT_S} s"
    seconds = time.perf_counter() - start
    lines = (done.stdout + done.stderr).strip().splitlines()
    failed = [line for line in lines if re.match(r"(FAILED|ERROR) ", line)]
    return done.returncode, seconds, (failed or lines or [""])[0 if failed else -1]


def run_mutant(m: Mutant) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        tree = pathlib.Path(tmp)
        copy_tree(tree)
        path = tree / m.file
        path.write_text(path.read_text().replace(m.original, m.replacement))
        code, seconds, detail = run_tests(tree, m.tests)
    # Exit code 5 (no tests collected) or 4 (usage) would be a broken list, not a kill.
    status = "killed" if code in (1, 2, -1) else "survived" if code == 0 else "error"
    return {**asdict(m), "status": status, "exit_code": code, "seconds": round(seconds, 1), "detail": detail}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.mutants", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the unmutated copy")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    check_fragments(MUTANTS)
    mutants = MUTANTS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTANTS})
        if unknown:
            parser.error(f"unknown mutants {unknown}; known: {[m.name for m in MUTANTS]}")
        mutants = [m for m in MUTANTS if m.name in args.only]
    start = time.perf_counter()
    baseline = None
    if not args.no_baseline:
        tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
        with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as tmp:
            copy_tree(pathlib.Path(tmp))
            code, seconds, detail = run_tests(pathlib.Path(tmp), tests)
        baseline = {"tests": tests, "exit_code": code, "seconds": round(seconds, 1)}
        print(f"baseline  {len(tests)} test files/ids, unmutated: exit {code} in {seconds:.0f} s")
        if code != 0:
            print(f"error: the tests fail without a mutant: {detail}", file=sys.stderr)
            return 2
    results = []
    for m in mutants:
        r = run_mutant(m)
        results.append(r)
        print(f"{r['status']:<9} {m.name:<36} {r['seconds']:6.1f} s  {r['detail']}", flush=True)
    killed = [r["name"] for r in results if r["status"] == "killed"]
    survived = [r["name"] for r in results if r["status"] == "survived"]
    errors = [r["name"] for r in results if r["status"] == "error"]
    seconds = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "total": len(results),
                "killed": len(killed),
                "survived": survived,
                "errors": errors,
                "seconds": round(seconds, 1),
                "baseline": baseline,
                "mutants": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(
        f"mutants: {len(killed)}/{len(results)} killed, {len(survived)} survived {survived}, "
        f"{len(errors)} errors, in {seconds:.0f} s"
    )
    return 0 if len(killed) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
