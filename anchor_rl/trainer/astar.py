"""A*-PO in the trainer (arXiv 2505.20686): the :class:`AStarPO` component.

Shapes: P prompts, B responses, T response tokens.

    set-up      stage 1: PVPO's presampling (:func:`~anchor_rl.trainer.pvpo.presample_anchors`:
                ``pvpo.m`` reference samples per training prompt, rows reused from
                ``pvpo.store``, ``pvpo.prompts`` of them), then V*(x) from each prompt's stored
                statistics (:func:`vstar_of`)
    each step   stage 2: ``vstar[B]``, ``ref_log_ratio[B]`` (the sampling policy's
                ``sum_t log pi_old - log pi_ref``) and ``beta`` (``astarpo.beta2``) for the
                ``astarpo`` estimator; the ``astarpo`` loss regresses on its target

The anchor store keeps per prompt the count of rollouts, of correct ones and the sum and
sum of squares of their rewards, not the draws. For rewards in {0, 1} (A*-PO's setting, and
the only one where ``sum r^2 = sum r`` with every reward in [0, 1]) those give V* exactly:
``beta1 * log(1 - p + p exp(1/beta1))`` with ``p`` the mean reward; other rewards are refused.

Rollout accounting: ``rollouts/presample`` counts the reference samples V* rests on, as
PVPO's does (cached rows included), so it joins ``rollouts/total``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from anchor_rl.algos.advantages import optimal_value_binary
from anchor_rl.anchors.store import AnchorStat
from anchor_rl.errors import AnchorRLError
from anchor_rl.rollout.engine import close_engine
from anchor_rl.tasks.base import Record
from anchor_rl.trainer.component import Component, Setup, Step
from anchor_rl.trainer.pvpo import presample_anchors, write_presample_report

BINARY_TOL = 1e-6


def vstar_of(stats: Mapping[str, AnchorStat], beta1: float) -> dict[str, float]:
    """Prompt id -> V*(x) from its reference statistics (rewards in {0, 1}).

    AnchorRLError naming a prompt whose stored rewards are not all 0 or 1 (then the
    statistics do not determine V*: the store keeps sums, not draws).
    """
    out = {}
    for pid, stat in stats.items():
        p = stat.reward_sum / stat.n
        binary = abs(stat.reward_sq_sum - stat.reward_sum) <= BINARY_TOL * max(1, stat.n)
        if not (binary and -BINARY_TOL <= p <= 1 + BINARY_TOL):
            raise AnchorRLError(
                f"A*-PO needs rewards in {{0, 1}}: prompt {pid}'s {stat.n} reference rewards "
                f"have mean {p:.4g} and mean square {stat.reward_sq_sum / stat.n:.4g}; the "
                "anchor store keeps their sums, from which V* is exact only for 0/1 rewards "
                "(use a task reward of 0 or 1, without reward.functions shaping)"
            )
        out[pid] = float(optimal_value_binary(torch.tensor(min(max(p, 0.0), 1.0)), beta1))
    return out


class AStarPO(Component):
    """A*-PO's offline V* and its regression inputs in a run (see the module docstring).

    records: the training prompts (those presampled). vstar: prompt id -> V*(x).
    """

    name = "astarpo"
    needs_logp = True  # ref_log_ratio reads the sampling policy's log-probs before the update

    def __init__(self, setup: Setup) -> None:
        cfg = setup.cfg
        self.cfg = cfg
        self.set = presample_anchors(setup)
        self.records = self.set.pool(self.set.records)
        if not setup.resuming:
            write_presample_report(setup.run_dir, cfg, self.set, self.records, None)
        ids = {r.id for r in self.records}
        self.vstar = vstar_of({k: s for k, s in self.set.stats.items() if k in ids},
                              cfg.astarpo.beta1)  # fmt: skip
        self.presample_rollouts = self.set.rollouts

    def training_records(self, records: list[Record]) -> list[Record]:
        return self.records

    def batch_vstar(self, step: Step) -> Tensor:
        """FloatTensor[B]: V* of each response's prompt."""
        scored = step.scored
        values = torch.tensor([self.vstar[r.id] for r in scored.records], dtype=torch.float32)
        return values[scored.batch.group]

    def advantage_inputs(self, step: Step) -> dict[str, Any]:
        """``vstar[B]``, ``ref_log_ratio[B]`` and ``beta`` (see the module docstring)."""
        if step.logp is None or step.ref_logp is None or step.mask is None:
            raise RuntimeError(
                "A*-PO needs the sampling policy's and the reference's log-probs before the "
                "update (kl.track=true and the separate re-scoring pass)"
            )
        log_ratio = ((step.logp - step.ref_logp) * step.mask).sum(-1)
        vstar = self.batch_vstar(step)
        step.metrics["astarpo/vstar_mean"] = vstar.mean().item()
        step.metrics["astarpo/ref_log_ratio_mean"] = log_ratio.mean().item()
        return {"vstar": vstar, "ref_log_ratio": log_ratio, "beta": self.cfg.astarpo.beta2}

    def state_dict(self) -> dict[str, Any]:
        return {"presample_rollouts": self.presample_rollouts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.presample_rollouts = int(state["presample_rollouts"])

    def close(self) -> None:
        """Close the reference's presampling engine (its own, built by presampling)."""
        close_engine(getattr(self.set.sampler, "engine", None))

    def counters(self) -> dict[str, float]:
        return {"rollouts/presample": float(self.presample_rollouts)}
