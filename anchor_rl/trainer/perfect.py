"""The perfect baseline in the trainer: a bound, not a method.

Shapes: G prompts (groups) of a step, B responses, K = ``perfect.samples``.

Each step, after the step's rollouts, :func:`policy_values` samples K more responses of the
current policy for each of the step's prompts (their own seed stream, ``perfect``, so they
never repeat a training rollout) and takes their mean training reward: an estimate of the
prompt's expected reward under the policy being trained, with standard error at most
``0.5 / sqrt(K)`` for rewards in [0, 1]. Those samples train nothing and are not counted
in any budget: ``rollouts/uncounted`` logs them apart from ``rollouts/total``.

- :class:`Perfect` (``advantage.estimator = "perfect"``): GRPO whose baseline is that
  estimate, ``A_i = r_i - V^pi(x)`` with no std scaling. It bounds what any baseline method
  (PVPO's anchor, V0.5's fused prior, a critic) can gain on the same rollouts.
- :class:`PerfectPrior` (``v05.prior = "perfect"``): V0.5 with that estimate as its prior,
  the bound of V0.5 (its fusion, test and budget then act on a prior that is right up to
  the estimate's noise).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from anchor_rl.rollout.engine import Engine
from anchor_rl.tasks.base import Task
from anchor_rl.trainer.collect import Scored, sampling_params, score, train_requests
from anchor_rl.trainer.component import Component, Setup, Step
from anchor_rl.trainer.config import TrainConfig

STREAM = "perfect"
"""The seed stream of the extra samples (a training rollout's is ``train``)."""
UNCOUNTED = "rollouts/uncounted"
"""The counter of the extra samples; ``run.counters`` leaves it out of ``rollouts/total``."""


def policy_values(
    engine: Engine, task: Task, cfg: TrainConfig, scored: Scored, samples: int
) -> tuple[Tensor, dict[str, float]]:
    """``(values[G], metrics)``: the mean training reward of ``samples`` fresh responses of the
    engine's (the current) policy to each of ``scored``'s G prompts, and ``perfect/*``
    metrics (``samples``, ``seconds``, ``value_mean``, ``gap``: the mean absolute gap between
    the step's own group means and the values)."""
    if scored.draws is None:
        raise ValueError("the perfect baseline needs the prompts' stream positions (Scored.draws)")
    started = time.perf_counter()
    g = len(scored.records)
    requests = train_requests(scored.records, scored.draws, samples, cfg.seed, stream=STREAM)
    batch = engine.rollout(
        requests, sampling_params(cfg, task), tools=task.tools or None,
        instruction=task.instruction,
    )  # fmt: skip
    batch.group = torch.arange(g).repeat_interleave(samples)
    graded = score(task, batch, scored.records, cfg)
    values = torch.zeros(g, dtype=torch.float64).index_add_(0, batch.group, graded.rewards.double())
    values = (values / samples).float()
    own = torch.zeros(g, dtype=torch.float64).index_add_(
        0, scored.batch.group, scored.rewards.double()
    ) / torch.bincount(scored.batch.group, minlength=g).clamp(min=1)
    metrics = {
        "perfect/samples": float(g * samples),
        "perfect/seconds": time.perf_counter() - started,
        "perfect/value_mean": values.mean().item(),
        "perfect/gap": (own.float() - values).abs().mean().item(),
    }
    return values, metrics


class Perfect(Component):
    """The perfect baseline's per-step estimate, ``policy_value[B]`` for the ``perfect``
    estimator (see the module docstring).

    uncounted: the extra samples drawn so far (checkpointed; ``rollouts/uncounted``).
    """

    name = "perfect"

    def __init__(self, setup: Setup) -> None:
        self.cfg, self.task, self.engine = setup.cfg, setup.task, setup.engine
        self.uncounted = 0
        self.values: Tensor | None = None  # [G] this step's

    def on_rollouts(self, step: Step) -> None:
        """Estimate the step's prompts' values with ``perfect.samples`` extra samples each."""
        self.values = None
        if len(step.scored) == 0:
            return
        k = self.cfg.perfect.samples
        self.values, metrics = policy_values(self.engine, self.task, self.cfg, step.scored, k)
        self.uncounted += k * len(step.scored.records)
        step.metrics |= metrics

    def advantage_inputs(self, step: Step) -> dict[str, Any]:
        """``policy_value[B]``: the estimate of each response's prompt."""
        if self.values is None:
            return {}
        return {"policy_value": self.values[step.scored.batch.group]}

    def state_dict(self) -> dict[str, Any]:
        return {"uncounted": self.uncounted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.uncounted = int(state["uncounted"])

    def counters(self) -> dict[str, float]:
        return {UNCOUNTED: float(self.uncounted)}


class PerfectPrior:
    """V0.5's ``perfect`` prior: predicts the values :meth:`set` gave this step's prompts
    (:func:`policy_values`); learns nothing from the rewards (the next step's estimate
    replaces it)."""

    name = "perfect"

    def __init__(self, reward_range: tuple[float, float] = (0.0, 1.0)) -> None:
        self.reward_range = reward_range
        self.values: dict[str, float] = {}

    def set(self, prompt_ids: Sequence[str], values: Tensor) -> None:
        """The step's estimates, ``values[P]`` for ``prompt_ids``, clamped to the reward range."""
        lo, hi = self.reward_range
        self.values = {
            pid: min(max(float(v), lo), hi) for pid, v in zip(prompt_ids, values, strict=True)
        }

    def predict(self, prompt_ids: Sequence[str], embeddings: Tensor | None = None) -> Tensor:
        """``[P]`` float32: the step's estimate of each prompt (KeyError for a prompt
        :meth:`set` did not give)."""
        return torch.tensor([self.values[pid] for pid in prompt_ids], dtype=torch.float32)

    def update(
        self, prompt_ids: Sequence[str], rewards: Sequence[Tensor], *_: Any, **__: Any
    ) -> None:
        """Nothing to learn."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""
