"""The ``critic`` config section: the value model and GAE of PPO and VAPO.

It is read only when ``advantage.estimator = "gae"``. It lives apart from the stage
functions (:mod:`anchor_rl.trainer.critic`) so that importing the config stays free of
torch and transformers (``anchor-rl --help`` stays fast).

Every VAPO technique that concerns the critic is one field here, switchable on its own:
value pretraining (``pretrain_steps``; 0 switches it off), decoupled GAE (``lam``;
``"policy"`` switches it off) and length-adaptive GAE (``policy_lam``; a number switches
it off). The other four are in other sections: ``loss.clip_high``, ``loss.agg``,
``loss.nll_coef`` and ``rollout.prompts_per_step`` x ``rollout.n``.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from anchor_rl.methods.knobs import changed, no_effect
from anchor_rl.section import Section

Lambda = Annotated[float, Field(ge=0, le=1)]
LAMBDA_MAX = 1.0 - 1e-6
"""The length-adaptive lambda's upper clamp, ``anchor_rl.algos.gae.LAMBDA_MAX`` (written
out here: this module imports no torch)."""


class CriticConfig(Section):
    """The critic of GAE (`advantage.estimator = "gae"`): model, optimiser, lambdas, value pretraining."""

    method: ClassVar[str] = "the critic"
    enable: ClassVar[str] = "advantage.estimator=gae"
    unused: ClassVar[str] = "advantage.estimator={est} has no critic (it does not read values)"

    mode: Literal["separate", "shared"] = "separate"
    """`separate`: a copy of the initial policy's backbone with a value head (PPO, VAPO).
    `shared`: a value head on the live policy's backbone, trained as a linear probe (value
    gradients never reach the policy)."""
    lr: float = Field(2e-4, gt=0)
    """Critic AdamW learning rate, constant (betas, weight decay, gradient clipping, epochs and
    mini-batches as in `optim`). Also the value-pretraining rate. Paper: 2e-6, twice the
    actor's 1e-6; ours is larger so the zero-initialised head reaches the mean reward
    within value pretraining's steps."""
    value_clip: float = Field(0.5, gt=0)
    """Clipped value loss: new values may move at most this far from the values the advantages
    were computed with before the clipped error takes over."""
    lam: Lambda | Literal["policy"] = 1.0
    """Decoupled GAE: lambda of the critic's value targets (returns). 1.0 (VAPO): Monte-Carlo
    returns for gamma = 1. `policy`: the policy's lambda (no decoupling, as in PPO)."""
    policy_lam: Lambda | Literal["adaptive"] = 0.95
    """Lambda of the policy's advantages: a number (PPO: 0.95), or `adaptive` (VAPO's
    length-adaptive GAE): 1 - 1/(lam_alpha * l) per response, l its policy-token count,
    clamped to [lam_min, 1 - 1e-6]."""
    lam_alpha: float = Field(0.05, gt=0)
    """alpha of the length-adaptive lambda (VAPO: 0.05). Responses of at most 1/alpha tokens get
    lam_min."""
    lam_min: float = Field(0.0, ge=0, lt=LAMBDA_MAX)
    """Lower clamp of the length-adaptive lambda, below its upper clamp 1 - 1e-6."""
    whiten: bool = True
    """Whiten the policy's advantages over the batch's policy tokens (mean 0, std 1), as verl
    and OpenRLHF do for GAE; the papers do not say."""
    pretrain_steps: int = Field(0, ge=0)
    """Value pretraining before RL (VAPO: 50): steps of fitting the critic to Monte-Carlo
    returns of the fixed initial policy, each on a fresh batch of prompts_per_step x n
    rollouts. 0 switches it off. The result is cached under $ANCHOR_RL_CACHE/critic."""
    pretrain_ev_threshold: float | None = Field(None, le=1)
    """Stop value pretraining early at the first step whose explained variance (measured on
    the fresh batch before training on it) reaches this; None: run all pretrain_steps."""

    def errors(self) -> list[str]:
        """The settings of a run with a critic that have no effect (empty: none)."""
        errors = []
        if self.policy_lam != "adaptive" and (names := changed(self, ("lam_alpha", "lam_min"))):
            why = "they shape the length-adaptive lambda: set critic.policy_lam=adaptive"
            errors.append(no_effect("critic", names, why))
        if self.pretrain_steps == 0 and changed(self, ("pretrain_ev_threshold",)):
            why = "critic.pretrain_steps=0 switches value pretraining off"
            errors.append(no_effect("critic", ["pretrain_ev_threshold"], why))
        return errors
