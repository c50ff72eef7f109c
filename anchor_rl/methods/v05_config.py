"""The ``v05`` section of the training config (V0.5, arXiv 2603.10848).

Kept apart from :mod:`anchor_rl.trainer.v05` (the stages) so the config, and with it
``anchor-rl --help``, imports neither torch nor transformers.

The section is read when ``advantage.estimator = "v05"``: the advantage is ``r - b`` with
``b`` the prompt's prior fused with its rollouts; ``rollout.n`` is ``k_init``, the rollouts
every prompt starts with, and ``rollout.budget = "adaptive"`` adds top-up rollouts where
the rollouts reject the prior.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from anchor_rl.methods.knobs import changed, no_effect
from anchor_rl.methods.pvpo_config import PVPOConfig
from anchor_rl.section import Section

PriorName = Literal["anchor", "history", "knn", "anchor+history", "knn+history", "perfect"]

ANCHOR_KNOBS = ("m", "prompts", "store", "presample_batch", "presample_seed")
"""The ``pvpo`` knobs V0.5's anchor prior reads (the presampling of the static anchors)."""


def check_reward_range(value: tuple[float, float]) -> tuple[float, float]:
    """``value`` when ``lo < hi``; ValueError otherwise, at config time: an empty or reversed
    range holds no reward, and would fail later, in the priors or the reward check."""
    lo, hi = value
    if not lo < hi:
        raise ValueError(f"must be (lo, hi) with lo < hi, got {list(value)}; e.g. [0, 1]")
    return value


class V05Knobs(Section):
    """The V0.5 knobs every host reads: the prior, the fusion's noise model and the rollout
    budget (the verl plug-in's ``v05`` section builds on them)."""

    prior: PriorName = "anchor+history"
    """The prior V: `anchor` (PVPO's static anchor: the reference's mean reward over `pvpo.m`
    presampled rollouts, stored in `pvpo.store`), `history` (per-prompt Beta posterior over the
    policy's own rollouts, base 1/2), `knn` (neighbours of the prompt in the policy's embedding
    space over recent outcomes), `anchor+history` / `knn+history` (the history posterior layered
    on that base), `perfect` (a bound, not a prior: each step, the mean reward of
    `perfect.samples` extra samples of the current policy, not counted in rollouts/total)."""
    sigma2: Literal["worst", "prior"] = "worst"
    """Per-rollout reward variance of the fusion: `worst` ((hi - lo)/2)^2 (the paper's 1 for +-1
    rewards), `prior` the Bernoulli variance at the prior (V - lo)(hi - V)."""
    k_max: int = Field(16, gt=0)
    """Most rollouts per prompt, top-ups included (paper: 16)."""
    cost: float | None = Field(None, ge=0)
    """Budget: add a rollout while it lowers the estimated baseline MSE by more than this. None:
    the paper's 0.0039 for +-1 rewards scaled by ((hi - lo)/2)^2 (0.000975 for 0/1 rewards)."""
    top_up_rounds: int = Field(2, ge=0)
    """Adaptive budget: most top-up rounds per step, each one batched engine call; the rule is
    evaluated on all rollouts so far before each round."""
    reward_range: tuple[float, float] = (0.0, 1.0)
    """(lo, hi) of the training reward, the priors' units; a reward outside it is an error."""
    history_strength: float = Field(4.0, gt=0)
    """`history` prior: weight of the base prior's prediction, in rollouts."""
    history_gamma: float = Field(0.95, gt=0, le=1)
    """`history` prior: per-step forgetting of past evidence (1 keeps everything)."""

    @field_validator("reward_range")
    @classmethod
    def _reward_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        return check_reward_range(value)


class V05Config(V05Knobs):
    """V0.5 (`advantage.estimator = "v05"`): the prior, the fusion's noise model and the rollout
    budget; `rollout.n` is k_init."""

    method: ClassVar[str] = "V0.5"
    enable: ClassVar[str] = "advantage.estimator=v05"
    unused: ClassVar[str] = "advantage.estimator={est} is not V0.5"

    knn_window: int = Field(256, gt=0)
    """`knn` prior: recent (prompt, mean reward) pairs in its context."""
    knn_top_k: int = Field(16, gt=0)
    """`knn` prior: neighbours per prediction."""
    knn_temperature: float = Field(0.1, gt=0)
    """`knn` prior: kernel temperature over cosine similarity."""

    def errors(self, pvpo: PVPOConfig, *, n: int, budget: str, overlong_cache: float) -> list[str]:
        """The settings of a V0.5 run that cannot mean what the user thinks (empty: none).

        pvpo: the run's ``pvpo`` section (the anchor prior's presampling); n: k_init
        (``rollout.n``); budget: ``rollout.budget``; overlong_cache: ``reward.overlong_cache``.
        """
        errors = []
        lo, hi = self.reward_range
        if self.prior.split("+")[0] == "anchor" and pvpo.refresh_every:
            errors.append(
                "v05.prior uses the static anchor, which V0.5 does not refresh: set "
                "pvpo.refresh_every=0 (the history layer follows the policy instead)"
            )
        if n > self.k_max:
            errors.append(f"rollout.n (k_init) = {n} exceeds v05.k_max = {self.k_max}")
        if overlong_cache > 0 and lo > -1:
            errors.append(
                "reward.overlong_cache punishes overlong responses down to -1, below "
                f"v05.reward_range={list(self.reward_range)}: set v05.reward_range=[-1, {hi}]"
            )
        if budget != "adaptive" and (names := changed(self, ("cost", "top_up_rounds"))):
            errors.append(
                no_effect("v05", names, 'they size top-ups: set rollout.budget="adaptive"')
            )
        knn = ("knn_window", "knn_top_k", "knn_temperature")
        if self.prior.split("+")[0] != "knn" and (names := changed(self, knn)):
            errors.append(no_effect("v05", names, f"v05.prior={self.prior} has no knn base"))
        history = ("history_strength", "history_gamma")
        if "history" not in self.prior and (names := changed(self, history)):
            errors.append(no_effect("v05", names, f"v05.prior={self.prior} has no history layer"))
        return errors
