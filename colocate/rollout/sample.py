"""The unit of data that flows from rollout to training."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One completion of one prompt, with everything the trainer needs."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    """Engine log-probs of each response token (protocol definition: temperature-scaled, untruncated)."""
    loss_mask: list[int]
    """Per response token: 1 if trained on, 0 for tokens the policy did not choose (tool output)."""
    group_index: int
    """Index of the prompt this sample belongs to; the samples of one group are consecutive."""
    sample_index: int = 0
    reward: float = 0.0
    """Reward after shaping (e.g. the over-long penalty); raw_reward keeps the function's value."""
    raw_reward: float = 0.0
    finish_reason: str = "length"
    """'stop', 'length', or 'abort' for a sample that partial rollout carries to the next step."""
    weight_version: int = 0
    """The engine's weight version when the sample finished (or was aborted)."""
    token_versions: list[int] = field(default_factory=list)
    """Per response token, the weight version that sampled it (partial rollout continues samples
    under newer weights); empty means every token was sampled with weight_version."""
    prompt_text: str = ""
    response_text: str = ""
    label: object = None
    metadata: dict = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def versions(self) -> list[int]:
        """The weight version of each response token."""
        return self.token_versions or [self.weight_version] * self.response_len

    def __post_init__(self):
        n = len(self.response_ids)
        if len(self.rollout_logprobs) != n or len(self.loss_mask) != n or len(self.token_versions) not in (0, n):
            raise ValueError(
                f"sample of group {self.group_index}: response_ids ({n}), rollout_logprobs "
                f"({len(self.rollout_logprobs)}), loss_mask ({len(self.loss_mask)}) and token_versions "
                f"({len(self.token_versions)}, or 0) differ in length"
            )
