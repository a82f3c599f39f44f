"""A custom generate hook used by the tests: two turns with a tool reply in between."""

from colocate.rollout.protocol import SamplingParams
from colocate.rollout.sample import Sample

TOOL_REPLY = [3, 4]  # tokens the policy did not choose: trained with loss_mask 0


def two_turns(engine, prompts, sampling, tokenizer):
    samples = []
    for prompt, sp in zip(prompts, sampling):
        first = engine.generate([prompt.prompt_ids], SamplingParams(**{**sp.__dict__, "max_new_tokens": 3, "ignore_eos": True}))
        for c in first:
            context = prompt.prompt_ids + c.output_ids + TOOL_REPLY
            second = engine.generate(
                [context], SamplingParams(**{**sp.__dict__, "n": 1, "max_new_tokens": 3, "ignore_eos": True})
            )[0]
            samples.append(
                Sample(
                    prompt_ids=list(prompt.prompt_ids),
                    response_ids=c.output_ids + TOOL_REPLY + second.output_ids,
                    rollout_logprobs=c.logprobs + [0.0] * len(TOOL_REPLY) + second.logprobs,
                    loss_mask=[1] * len(c.output_ids) + [0] * len(TOOL_REPLY) + [1] * len(second.output_ids),
                    group_index=prompt.index,
                    sample_index=c.sample_index,
                    finish_reason=second.finish_reason,
                    weight_version=second.weight_version,
                    prompt_text=prompt.prompt_text,
                    label=prompt.label,
                    metadata=prompt.metadata,
                )
            )
    return samples
