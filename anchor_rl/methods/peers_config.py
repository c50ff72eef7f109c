"""The ``astarpo`` and ``perfect`` config sections: A*-PO, the nearest published relative of
PVPO's static anchor, and the perfect baseline, the bound of every baseline method.

Kept apart from the components (:mod:`anchor_rl.trainer.astar`,
:mod:`anchor_rl.trainer.perfect`) so that importing the config needs no torch. A*-PO's
reference samples are PVPO's presampled anchors (``pvpo.m`` per prompt, ``pvpo.store``,
``pvpo.prompts``...); its V* is computed from their statistics.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from anchor_rl.section import Section

ASTARPO_PVPO_KNOBS = ("m", "prompts", "store", "presample_batch", "presample_seed")
"""The ``pvpo`` knobs A*-PO's stage 1 reads (the presampling of the reference samples)."""


class AStarPOConfig(Section):
    """A*-PO (`advantage.estimator = "astarpo"`, arXiv 2505.20686): V* from reference samples,
    then a least-squares regression on one policy sample per prompt."""

    method: ClassVar[str] = "A*-PO"
    enable: ClassVar[str] = "advantage.estimator=astarpo"
    unused: ClassVar[str] = "advantage.estimator={est} is not A*-PO"

    beta1: float = Field(0.5, gt=0)
    """Stage 1: V*(x) = beta1 * log(mean_j exp(r_j / beta1)) over the `pvpo.m` reference
    samples of each prompt (the paper's and TRL's 0.5; -> mean reward as beta1 grows, -> best
    reward as it shrinks). Needs rewards in {0, 1} (the anchor store keeps counts, not draws)."""
    beta2: float = Field(1e-3, gt=0)
    """Stage 2: the regression (beta2 * log(pi/pi_ref) - (r - V*))^2, averaged over the
    responses (the paper's and TRL's 1e-3); the loss `astarpo` reads it."""

    def errors(self, cfg: Any) -> list[str]:
        """The settings of an A*-PO run that cannot mean what the user thinks (empty: none)."""
        errors = []
        if cfg.loss.policy_loss != "astarpo":
            errors.append(
                f"advantage.estimator=astarpo with loss.policy_loss={cfg.loss.policy_loss}: the "
                "estimator's target is A*-PO's regression target, not an advantage for a "
                "surrogate; set loss.policy_loss=astarpo (or start from --preset astarpo)"
            )
        if cfg.loss.agg == "token-mean":
            errors.append(
                "loss.agg=token-mean with A*-PO: its loss is a mean over responses, and the "
                "update weighs micro-batches by loss.agg's count; set loss.agg=seq-mean-token-sum"
            )
        if cfg.kl.in_reward:
            errors.append(
                "kl.in_reward=true with A*-PO: its regression already holds the policy to the "
                "reference through astarpo.beta2, and a KL in the reward would move the target "
                "r - V*; set kl.in_reward=false (kl.coef adds a separate KL loss)"
            )
        if not cfg.kl.track and cfg.kl.coef == 0:
            errors.append(
                "kl.track=false with A*-PO: its loss needs the reference's log-probs, which "
                "the run computes only to track or penalise the KL; set kl.track=true"
            )
        if cfg.filter.kind != "none":
            errors.append(
                f"filter.kind={cfg.filter.kind} with A*-PO: it trains on every prompt's one "
                "sample against V* (dynamic sampling would drop every single-sample group, "
                "group sampling is PVPO's); set filter.kind=none"
            )
        if cfg.reward.overlong_cache > 0:
            errors.append(
                "reward.overlong_cache with A*-PO: V* comes from the reference's task rewards "
                "in {0, 1}, without the punishment; drop reward.overlong_cache"
            )
        if cfg.pvpo.refresh_every:
            errors.append(
                "pvpo.refresh_every with A*-PO: V* is estimated once, offline (stage 1); set "
                "pvpo.refresh_every=0"
            )
        return errors


class PerfectConfig(Section):
    """The perfect baseline (`advantage.estimator = "perfect"`, or `v05.prior = "perfect"`):
    each prompt's expected reward under the current policy, estimated every step from extra
    samples that no budget counts (a bound, not a method)."""

    method: ClassVar[str] = "the perfect baseline"
    enable: ClassVar[str] = 'advantage.estimator=perfect or v05.prior="perfect"'
    unused: ClassVar[str] = "advantage.estimator={est} has no perfect baseline"

    samples: int = Field(32, gt=0)
    """K: extra samples of the current policy per prompt and step; their mean reward is the
    baseline (its standard error is at most 0.5/sqrt(K) for rewards in [0, 1]). Logged as
    `rollouts/uncounted`, never in `rollouts/total`."""


def policy_loss_options(cfg: Any) -> dict[str, float]:
    """Keyword options the run's policy loss takes from its method's section: A*-PO's
    ``beta`` (``astarpo.beta2``) for ``loss.policy_loss = "astarpo"``; none otherwise."""
    if cfg.loss.policy_loss == "astarpo":
        return {"beta": cfg.astarpo.beta2}
    return {}


def uses_perfect(cfg: Any) -> bool:
    """Whether the run reads the ``perfect`` section (the estimator or V0.5's prior)."""
    return "perfect" in cfg.methods or ("v05" in cfg.methods and cfg.v05.prior == "perfect")


def astarpo_loss_errors(cfg: Any) -> list[str]:
    """``loss.policy_loss = "astarpo"`` without the ``astarpo`` estimator: refused."""
    if cfg.loss.policy_loss == "astarpo" and cfg.advantage.estimator != "astarpo":
        return [
            f"loss.policy_loss=astarpo with advantage.estimator={cfg.advantage.estimator}: the "
            "regression's target is the astarpo estimator's (r - V* minus the sampling "
            "policy's implicit reward); set advantage.estimator=astarpo"
        ]
    return []


__all__ = [
    "ASTARPO_PVPO_KNOBS",
    "AStarPOConfig",
    "PerfectConfig",
    "astarpo_loss_errors",
    "policy_loss_options",
    "uses_perfect",
]
