"""The method state of the ``anchor_rl`` trainer and its advantage step on a verl ``DataProto``.

Shapes: B responses (rows of the batch), T response tokens (verl's right-padded response
width), G prompts of the step (distinct ``uid``). The ``DataProto`` is the one verl's v1
trainer builds in its advantage stage: ``batch`` holds ``token_level_scores[B, T]`` (the
reward, outcome on the last response token), ``token_level_rewards[B, T]`` (the same, minus
the KL penalty when it is in the reward), ``response_mask[B, T]`` and, with a critic,
``values[B, T]``; ``non_tensor_batch`` holds ``uid[B]`` (one uuid per prompt and step) and,
for the per-prompt methods, ``raw_prompt[B]``, ``reward_model[B]`` and, where the dataset
has it, ``data_source[B]`` (the chat messages, the gold answer and the name that picks
verl's reward function: the row key, :func:`~.data.row_key`; no ``data_source`` keys every
row with None, as presampling keys a dataset row without one).

Every number comes from anchor-rl: PVPO's ``r - V_sta`` and V0.5's ``r - b`` through the
estimators registered with verl (:mod:`.estimators`, which call :mod:`anchor_rl.algos`),
V0.5's prior, fusion and budget from :mod:`anchor_rl.methods.v05`, VAPO's GAE from
:mod:`anchor_rl.algos` and its decoupled returns, whitening and length-adaptive lambda from
:mod:`anchor_rl.methods.vapo`. Nothing needs an anchor-rl run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from anchor_rl.algos.registry import compute_advantage as anchor_advantage
from anchor_rl.anchors.records import AnchorStat, TeacherTrajectory, anchor_values
from anchor_rl.integrations.verl import ESTIMATORS
from anchor_rl.integrations.verl.config import MethodConfig, select
from anchor_rl.integrations.verl.data import batch_row_keys
from anchor_rl.methods.groups import first_rows, group_index
from anchor_rl.methods.v05 import Fusion, V05Step, build_prior
from anchor_rl.methods.vapo import critic_metrics, critic_targets, policy_lambda

__all__ = ["MethodState", "V05Plan", "check_resume", "outcome"]

NLL_WEIGHT = "anchor_rl_nll_weight"
"""The per-row field VAPO's actor loss reads (:mod:`.losses`)."""


def outcome(token_level: Tensor) -> Tensor:
    """Outcome rewards ``[B]``: the sum of token-level rewards ``[B, T]`` over the response
    (verl puts the outcome on the last response token; a KL in the reward adds its terms)."""
    return token_level.sum(dim=-1)


@dataclass
class V05Plan:
    """V0.5's state between a step's sampling (top-ups) and its advantage stage.

    uids: the step's prompts ``[G]`` (verl's uid). step: the prior's prediction and the
    fusion on the first ``rollout.n`` rollouts, keyed by the row keys (messages, gold answer
    and data source). rounds: top-up rounds run.
    """

    uids: list[str]
    step: V05Step
    rounds: int = 0


class MethodState:
    """What the ``anchor_rl`` trainer keeps between steps.

    anchors: row key (:func:`~.data.row_key`: messages, gold answer, data source) -> the
        reference's statistics (PVPO's ``V_sta`` is their mean), for the methods that read
        them; None otherwise. anchor_key: the store digest they are under.
    trajectories: row key -> teacher trajectory (PVPO's group sampling).
    prior: V0.5's prior (learns every step's rewards; checkpointed).
    """

    def __init__(
        self,
        cfg: MethodConfig,
        anchors: Mapping[str, AnchorStat] | None = None,
        anchor_key: str | None = None,
        trajectories: Mapping[str, TeacherTrajectory] | None = None,
    ) -> None:
        self.cfg = cfg
        self.anchors = dict(anchors) if anchors is not None else None
        self.anchor_key = anchor_key
        self.trajectories = dict(trajectories or {})
        self.vc = cfg.v05.v05_config()
        self.prior = None
        self.plan: V05Plan | None = None
        if cfg.method == "v05":
            if cfg.uses_anchors and self.anchors is None:
                raise ValueError("the V0.5 anchor prior needs the presampled anchors")
            means = None if self.anchors is None else {k: s.mean for k, s in self.anchors.items()}
            self.prior = build_prior(self.vc, means)

    # -- per-prompt inputs ---------------------------------------------------------------

    def anchor_of(self, keys: Sequence[str]) -> Tensor:
        """FloatTensor[len(keys)]: the static anchor of each row key (KeyError naming the
        prompts the anchors in use do not cover)."""
        if self.anchors is None:
            raise ValueError(f"anchor_rl.method={self.cfg.method} reads no anchors")
        return anchor_values(self.anchors, keys)

    def v05_plan(
        self, uids: Sequence[str], keys: Sequence[str], rewards: Tensor, group: Tensor
    ) -> V05Plan:
        """The prior's prediction for the step's prompts and the fusion on their first
        rollouts (``rewards[B]``, ``group[B]`` in ``0..G-1``); kept for the advantage stage."""
        assert self.prior is not None
        self.plan = V05Plan(list(uids), V05Step.begin(self.prior, self.vc, keys, rewards, group))
        return self.plan

    def v05_extra(self, rewards: Tensor, group: Tensor) -> Tensor:
        """More rollouts each prompt of the plan asks for, ``[G]`` int64, given every rollout so
        far (``rewards[B]``, ``group[B]``): anchor-rl's budget rule (0 where the prior holds)."""
        assert self.plan is not None
        return self.plan.step.extra(self.vc, rewards, group)

    # -- the advantage stage -------------------------------------------------------------

    def advantage_step(
        self, data: Any, algo: Any, num_repeat: int = 1, valid: Tensor | None = None
    ) -> dict[str, float]:
        """Write ``advantages[B, T]`` and ``returns[B, T]`` into ``data.batch`` (a verl
        ``DataProto``) for the configured method; return its metrics.

        ``algo`` is verl's ``algorithm`` config (``gamma``, ``lam``). ``valid[B]`` (bool) marks
        real rows: verl pads a batch with copies of a real row's prompt and an empty
        response, which must neither join a prompt's group nor teach the prior (default: all
        valid). PVPO and V0.5 put the per-prompt baseline in ``reward_baselines[B]`` and run
        verl's ``compute_advantage`` with their registered estimator; VAPO computes its two
        GAEs here (and writes ``anchor_rl_nll_weight[B]`` for its actor loss).
        """
        from verl.trainer.ppo.ray_trainer import compute_advantage

        method = self.cfg.method
        batch, nt = data.batch, data.non_tensor_batch
        size = batch["response_mask"].shape[0]
        valid = torch.ones(size, dtype=torch.bool) if valid is None else valid.to(torch.bool)
        if method == "vapo":
            return self._vapo(data, algo, valid)
        uids = [str(u) for u in nt["uid"]]
        rows = valid.nonzero().flatten().tolist()
        group, order = group_index([uids[r] for r in rows])
        if "raw_prompt" not in nt:
            raise KeyError(
                f"anchor_rl.method={method} keys its baselines by raw_prompt[B], "
                "reward_model[B] (the gold answer) and data_source[B]"
            )
        firsts = [rows[r] for r in first_rows(group, len(order))]
        keys = batch_row_keys(nt, firsts)
        if method == "pvpo":
            per_group = self.anchor_of(keys)
            metrics = {"pvpo/anchor_mean": per_group[group].mean().item()} if rows else {}
            teacher = nt.get("anchor_rl_teacher")
            if teacher is not None:
                metrics["pvpo/teacher_rows"] = float(sum(bool(teacher[r]) for r in rows))
        else:
            scores = outcome(batch["token_level_scores"])[rows]
            per_group, metrics = self._v05(scores, group, order, keys)
        rewards = batch["token_level_rewards"]
        baselines = torch.zeros(size, dtype=rewards.dtype)
        baselines[rows] = per_group[group].to(rewards.dtype)
        batch["reward_baselines"] = baselines
        try:
            compute_advantage(
                data,
                adv_estimator=ESTIMATORS[method],
                gamma=float(select(algo, "gamma", 1.0)),
                lam=float(select(algo, "lam", 1.0)),
                num_repeat=num_repeat,
                norm_adv_by_std_in_grpo=bool(select(algo, "norm_adv_by_std_in_grpo", True)),
                config=algo,
            )
        finally:
            batch.pop("reward_baselines")
        return metrics

    def _v05(
        self, rewards: Tensor, group: Tensor, uids: list[str], keys: list[str]
    ) -> tuple[Tensor, dict[str, float]]:
        """The fused baseline ``[G]`` of the step's prompts (``rewards[B]`` of the valid rows,
        ``group[B]`` in ``0..G-1`` over ``uids[G]``), then the prior's update."""
        assert self.prior is not None
        plan, self.plan = self.plan, None
        if plan is None or sorted(plan.uids) != sorted(uids):  # no sampling hook ran
            step, rounds = V05Step.begin(self.prior, self.vc, keys, rewards, group), 0
        else:  # the hook's prediction, in this batch's group order (verl reorders rows)
            perm = torch.tensor([plan.uids.index(u) for u in uids], dtype=torch.long)
            first = Fusion(*(getattr(plan.step.first, f.name)[perm] for f in fields(Fusion)))
            step, rounds = V05Step(list(keys), plan.step.prior[perm], first), plan.rounds
        baseline, _, metrics = step.finish(self.prior, self.vc, rewards, group, rounds)
        return baseline, metrics

    def _vapo(self, data: Any, algo: Any, valid: Tensor) -> dict[str, float]:
        """Decoupled, length-adaptive GAE on verl's critic values (docs/vapo.md)."""
        batch = data.batch
        if "values" not in batch:
            raise KeyError("anchor_rl.method=vapo needs the critic's values[B, T] in the batch")
        mask = batch["response_mask"].float()
        token_rewards = batch["token_level_rewards"].float()
        values = batch["values"].float()
        cc, gamma = self.cfg.vapo.critic_config(), float(select(algo, "gamma", 1.0))
        lam = policy_lambda(cc, mask)
        advantages = anchor_advantage(
            "gae", token_rewards=token_rewards, values=values, mask=mask, gamma=gamma, lam=lam
        )
        inputs = {"mask": mask, "token_rewards": token_rewards, "values": values}
        advantages, returns = critic_targets(cc, gamma, inputs, advantages)
        scores = outcome(batch["token_level_scores"].float())
        metrics = critic_metrics(values, returns, advantages, lam, mask, scores)
        dtype = batch["token_level_rewards"].dtype
        batch["advantages"], batch["returns"] = advantages.to(dtype), returns.to(dtype)
        batch[NLL_WEIGHT] = nll_weights(scores, mask, self.cfg.correct_threshold)
        positive = (scores >= self.cfg.correct_threshold)[valid]
        metrics["vapo/positive_frac"] = positive.float().mean().item() if len(positive) else 0.0
        return {f"anchor_rl/{k}": v for k, v in metrics.items()}

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The method's state as plain data (the V0.5 prior; the anchors' key)."""
        return {
            "method": self.cfg.method,
            "anchor_key": self.anchor_key,
            "prior": None if self.prior is None else self.prior.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (refused when it is another method's, or its anchors are
        under another key: :func:`check_resume`)."""
        check_resume(state, self.cfg.method, self.anchor_key)
        if self.prior is not None and state["prior"] is not None:
            self.prior.load_state_dict(state["prior"])


def check_resume(state: Mapping[str, Any], method: str, anchor_key: str | None) -> None:
    """Refuse to resume from a checkpoint's method state ``state`` (:meth:`MethodState.state_dict`)
    made by another method, or whose anchors are under another store key than this run's
    ``anchor_key``: its prior, teacher rows and advantages rest on those anchors."""
    if state["method"] != method:
        raise ValueError(
            f"the checkpoint holds anchor_rl.method={state['method']}, this run is {method}"
        )
    saved = state.get("anchor_key")
    if saved != anchor_key:
        raise ValueError(
            f"the checkpoint's anchors are under the presample key {saved}, this run's under "
            f"{anchor_key}: the reference model, its tokenizer, the rollout's sampling "
            "settings, data.train_files, data.prompt_key, the reward function or "
            "anchor_rl.correct_threshold changed since it was saved. Resume with the settings "
            f"it was saved with, or set anchor_rl.pvpo.anchor_key={saved} to keep its anchors, "
            "or start a new run in another trainer.default_local_dir"
        )


def nll_weights(scores: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """VAPO's NLL weight per row ``[B]``: ``1 / share`` on correct responses (``scores >=
    threshold``), 0 elsewhere, where ``share`` is the fraction of the batch's response tokens
    that belong to correct responses. verl normalises a micro-batch's loss by its mini-batch's
    token count; these weights turn that into the mean over correct responses' tokens
    (exact when a mini-batch's correct share equals the step's, e.g. one mini-batch)."""
    positive = (scores >= threshold).to(mask.dtype)
    tokens = mask.sum(dim=-1)
    total = tokens.sum()
    share = (tokens * positive).sum() / total if total > 0 else total
    if share <= 0:
        return torch.zeros_like(positive)
    return positive / share
