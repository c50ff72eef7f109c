"""What the anchor store holds, as values: a prompt's reference statistics
(:class:`AnchorStat`, PVPO's static anchor) and a teacher's correct trajectory
(:class:`TeacherTrajectory`). :mod:`anchor_rl.anchors.store` reads and writes them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AnchorStat:
    """Reference-rollout statistics of one prompt under one key.

    ``mean`` is PVPO's static anchor ``V_sta``; ``accuracy`` (the fraction of rollouts the
    task judged correct) drives the group-sampling filter. ``created``/``updated`` are
    Unix times of the first and the latest rollouts merged in.
    """

    prompt_id: str
    n: int
    n_correct: int
    reward_sum: float
    reward_sq_sum: float
    created: float
    updated: float

    @property
    def mean(self) -> float:
        """Mean reward of the ``n`` rollouts (the anchor)."""
        return self.reward_sum / self.n

    @property
    def accuracy(self) -> float:
        """Fraction of the ``n`` rollouts judged correct."""
        return self.n_correct / self.n

    @property
    def std(self) -> float:
        """Population standard deviation of the rewards."""
        return math.sqrt(max(0.0, self.reward_sq_sum / self.n - self.mean**2))

    @property
    def all_correct(self) -> bool:
        """Every rollout correct (accuracy exactly 1)."""
        return self.n_correct == self.n

    @property
    def none_correct(self) -> bool:
        """No rollout correct (accuracy exactly 0)."""
        return self.n_correct == 0


@dataclass(frozen=True, eq=False)
class TeacherTrajectory:
    """A correct completion of one prompt, in the POLICY's token ids, with the teacher's log-probs.

    token_ids: LongTensor[L], the response tokens (no prompt) in the policy vocabulary.
    logprobs: FloatTensor[L], log pi_gt of each token under the teacher (the "old" policy of
        its importance ratio); 0 where ``loss_mask`` is 0.
    loss_mask: FloatTensor[L], 1 on tokens the teacher wrote, 0 on tool output.
    text: the completion text (tool turns included), what the verifier accepted.
    reward: the task's reward of ``text``.
    teacher: which teacher produced it (e.g. ``hf``, ``http:<model>``, ``oracle``).
    tries: samples the teacher drew for this prompt, the successful one included.
    """

    prompt_id: str
    token_ids: Tensor
    logprobs: Tensor
    loss_mask: Tensor
    text: str
    reward: float
    teacher: str
    tries: int = 1

    def __post_init__(self) -> None:
        shape = self.token_ids.shape
        if self.token_ids.dim() != 1 or shape[0] == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D tensor, got shape {tuple(shape)}")
        for name in ("logprobs", "loss_mask"):
            if getattr(self, name).shape != shape:
                raise ValueError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}"
                )
        if not torch.isfinite(self.logprobs).all():
            raise ValueError(f"prompt {self.prompt_id}: teacher log-probs must be finite")
        if (self.logprobs * (1 - self.loss_mask)).abs().max() > 0:
            raise ValueError(f"prompt {self.prompt_id}: log-probs must be 0 where loss_mask is 0")
        if self.loss_mask.sum() == 0:
            raise ValueError(
                f"prompt {self.prompt_id}: the trajectory has no teacher-written token"
            )

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


def anchor_values(stats: Mapping[str, AnchorStat], prompt_ids: Sequence[str]) -> Tensor:
    """FloatTensor[P]: the anchor (mean reference reward) of each prompt, in order.

    Raises ``KeyError`` naming the prompts that have no anchor.
    """
    missing = [pid for pid in prompt_ids if pid not in stats]
    if missing:
        raise KeyError(
            f"{len(missing)} prompt(s) have no anchor (first: {missing[:5]}); run presample first"
        )
    return torch.tensor([stats[pid].mean for pid in prompt_ids], dtype=torch.float32)
