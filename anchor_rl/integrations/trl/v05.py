"""V0.5 as a TRL ``GRPOTrainer``: each group's rewards fused with the prompt's prior,
advantages ``r - b(prompt)`` (:class:`V05GRPOTrainer`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from anchor_rl.algos.registry import compute_advantage
from anchor_rl.anchors.priors import HistoryPrior, prompt_embeddings
from anchor_rl.errors import ConfigError
from anchor_rl.integrations.trl.base import AnchoredGRPOTrainer
from anchor_rl.integrations.trl.checks import UnsupportedFeatureError, section
from anchor_rl.methods.knobs import changed
from anchor_rl.methods.pvpo import AnchorSet
from anchor_rl.methods.pvpo_config import PVPOConfig
from anchor_rl.methods.v05 import V05Step, build_prior, check_rewards, uses_anchors, uses_embeddings
from anchor_rl.methods.v05_config import V05Config
from anchor_rl.models.tokenizer import encode_prompt

__all__ = ["V05GRPOTrainer"]


class V05GRPOTrainer(AnchoredGRPOTrainer):
    """TRL's GRPO with V0.5's baseline: each group's rewards fused with the prompt's prior.

    Per generation batch, for each prompt's group of ``k = num_generations`` rewards: the
    prior ``V`` (``methods.v05.build_prior``: the anchor, the history posterior or knn, as
    ``v05.prior`` says), the real-time test of the prior and the fusion
    (``methods.v05.fuse_groups``: positive-part James-Stein, ``algos.v05.fuse``), the
    advantage ``r - b`` (``algos.advantages.v05``), then the prior learns the group's rewards.
    The history prior's forgetting clock counts anchor-rl's steps, the policy versions that
    sampled training rollouts: one per generation batch sampled from new weights, whatever
    ``num_iterations`` and the accumulation; batches sampled from the same weights share one
    (:meth:`_clock`). The prior is saved in every TRL checkpoint and restored on resume.

    v05: V0.5's knobs (``anchor_rl.methods.v05_config.V05Config`` or a mapping of its
        fields). ``v05.top_up_rounds`` is not offered.
    pvpo: presampling of the ``anchor`` prior's anchors (``m``, ``store``,
        ``presample_batch``, ``presample_seed``; every prompt is presampled at start); only
        with an anchor-based prior.
    budget: ``fixed`` (``num_generations`` per prompt). ``adaptive`` (top-up rollouts where
        the prior is rejected) raises :class:`UnsupportedFeatureError`: TRL generates the
        same number of completions for every prompt and reshapes the rewards to
        ``[-1, num_generations]``. What the budget rule would have asked for is logged as
        ``v05/extra_rollouts_wanted``.

    The rest as :class:`AnchoredGRPOTrainer`. After set-up: ``prior`` (its state) and
    ``anchor_set`` (None without an anchor-based prior).
    """

    def __init__(
        self,
        *args: Any,
        v05: V05Config | Mapping[str, Any] | None = None,
        pvpo: PVPOConfig | Mapping[str, Any] | None = None,
        budget: Literal["fixed", "adaptive"] = "fixed",
        **kwargs: Any,
    ) -> None:
        vc = section(V05Config, v05, "v05")
        pc = section(PVPOConfig, pvpo, "pvpo")
        _check_v05(vc, pvpo is not None, pc, budget)
        super().__init__(*args, **kwargs)
        if self.num_generations > vc.k_max:
            raise ConfigError(
                f"num_generations={self.num_generations} above v05.k_max={vc.k_max}: raise v05.k_max"
            )
        self.v05 = vc
        self.anchor_set: AnchorSet | None = None
        anchors = None
        if uses_anchors(vc):
            self.anchor_set = self._presample_start(self._reference(), self._unique_records(), pc)
            anchors = self.anchor_set.means()
        self.prior = build_prior(vc, anchors)
        # state.global_step when the prior last learned (None: not yet in this process)
        self._prior_version: int | None = None

    def _advantages(
        self, rewards: Tensor, ids: Sequence[str], k: int
    ) -> tuple[Tensor, dict[str, float]]:
        """Fuse each group's rewards with its prior; ``algos.advantages.v05``: ``r - b``, ``[N]``."""
        vc = self.v05
        check_rewards(rewards, vc)
        prompts = list(ids[::k])
        group = torch.arange(len(ids)) // k
        emb = self._embed(prompts) if uses_embeddings(vc) else None
        step = V05Step.begin(self.prior, vc, prompts, rewards, group, emb)
        wanted = float(step.extra(vc, rewards, group).sum())
        baseline, _, metrics = step.finish(self.prior, vc, rewards, group, 0, **self._clock())
        advantages = compute_advantage("v05", rewards=rewards, baseline=baseline[group])
        return advantages, metrics | {"v05/extra_rollouts_wanted": wanted}

    def _clock(self) -> dict[str, bool]:
        """How the prior learns a generation batch's groups (``Prior.update``'s keywords), on
        anchor-rl's step clock.

        anchor-rl's V0.5 updates the prior once per training step, a step being one batch of
        rollouts sampled from the current weights and then trained on for ``optim.epochs x
        optim.mini_batches`` optimizer steps (``trainer.loop.train_step``); the history
        prior's forgetting clock (``HistoryPrior.step``) thus counts the policy versions that
        sampled training rollouts, neither optimizer steps nor rollout batches. In TRL a
        generation batch is sampled from the weights after ``state.global_step`` optimizer
        steps and trained on by ``steps_per_generation * num_iterations`` micro-steps, so:

        - a generation batch sampled from new weights is one step: it advances the clock by
          one, however many optimizer steps then train on it (``num_iterations``, TRL's
          epochs; ``steps_per_generation / gradient_accumulation_steps``, its mini-batches);
        - generation batches sampled from the same weights (``steps_per_generation <
          gradient_accumulation_steps``: one optimizer step spans several) are one step:
          the first advances the clock and the others join it, their evidence added at the
          same clock value, undiscounted, as anchor-rl's one update with the whole step's
          rollouts would add it. (Each batch is still fused with the prior as it stands
          when the batch is scored, so a later batch of the step sees the earlier ones.)
        """
        version, last = self.state.global_step, self._prior_version
        self._prior_version = version
        if isinstance(self.prior, HistoryPrior):
            return {"advance": version != last}
        return {}  # no clock

    def _embed(self, prompts: Sequence[str]) -> Tensor:
        """``[G, D]``: each prompt embedded by the policy, on the ids it is sampled from."""
        ids = [
            encode_prompt(self._tokenizer, self.records_by_id[p].prompt, self.task.instruction)
            for p in prompts
        ]
        return prompt_embeddings(self.accelerator.unwrap_model(self.model), None, ids)

    def _plugin_state(self) -> dict[str, Any]:
        return super()._plugin_state() | {"prior": self.prior.state_dict()}

    def _load_plugin_state(self, state: Mapping[str, Any]) -> None:
        super()._load_plugin_state(state)
        self.prior.load_state_dict(state["prior"])


def _check_v05(vc: V05Config, pvpo_given: bool, pc: PVPOConfig, budget: str) -> None:
    if budget == "adaptive":
        raise UnsupportedFeatureError(
            "budget='adaptive': V0.5's top-up rollouts need more completions for some prompts "
            "than others, and TRL's GRPOTrainer generates num_generations per prompt (its "
            "RepeatSampler) and reshapes the rewards to [-1, num_generations] in "
            "_generate_and_score_completions; use budget='fixed' (v05/extra_rollouts_wanted "
            "logs what the rule would add), or anchor-rl train --preset v05"
        )
    if budget != "fixed":
        raise ConfigError(f"budget={budget!r}: choose 'fixed' ('adaptive' is not offered)")
    if changed(vc, ("top_up_rounds",)):
        raise ConfigError("v05.top_up_rounds sizes top-ups, which the TRL plug-in does not sample")
    if pvpo_given and not uses_anchors(vc):
        raise ConfigError(
            f"pvpo with v05.prior={vc.prior!r}: nothing presamples; drop pvpo, or an anchor prior"
        )
    read = ("m", "store", "presample_batch", "presample_seed")
    extra = changed(pc, tuple(f for f in PVPOConfig.model_fields if f not in read))
    if extra:
        raise ConfigError(
            f"pvpo.{', pvpo.'.join(extra)}: V05GRPOTrainer reads pvpo.m, pvpo.store, "
            "pvpo.presample_batch and pvpo.presample_seed only (group sampling is "
            "PVPOGRPOTrainer's)"
        )
