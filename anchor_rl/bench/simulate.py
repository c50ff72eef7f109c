"""Monte-Carlo simulator of advantage-baseline error with known success probabilities.

Every grid cell is a prompt with a known success probability ``p`` and a prior whose value
is off by ``bias`` (in probability units). Each trial samples up to ``k_max`` Bernoulli(p)
rollouts and every baseline estimator is computed from the same rollouts (common random
numbers), so differences between estimators are not sampling noise of separate draws.

Reward forms: ``"pm1"`` (rewards -1/+1, the V0.5 paper's) and ``"binary"`` (rewards 0/1).
The true expected reward is ``mu = lo + (hi - lo) * p`` (``2p - 1`` or ``p``) and every MSE
is ``E[(baseline - mu)^2]`` in the reward units in use, so a +-1 MSE is 4x the 0/1 one.

Estimators (``k`` rollouts each unless stated):

* ``group_mean_k{k}``: the GRPO baseline, the mean of the group; MSE = Var(r) / k.
* ``loo_k{k}``: the RLOO baseline of each sample (mean of the other ``k - 1``), its MSE
  averaged over the group's samples; MSE = Var(r) / (k - 1).
* ``anchor``: a static anchor measured at step 0 while the policy drifted by ``bias``: its
  value is the prior ``V`` (below); no rollouts; MSE = ((hi - lo) * bias)^2.
* ``v05_k{k}``: V0.5 fusion (``anchor_rl.algos.v05.fuse``) of the ``k``-rollout mean with
  the prior ``V``, no extra rollouts.
* ``v05_adaptive``: V0.5 with the budget rule: ``k_init`` rollouts, then
  ``v05.extra_rollouts`` more in one round (as a trainer batches them), capped at
  ``k_max``, then fusion of all of them; reports the mean rollouts used.
* ``oracle``: the true ``mu``; MSE 0, the reference line.

The prior: ``V = p - bias`` (the policy improved by ``bias`` since the anchor was measured),
or ``p + bias`` where ``p - bias < 0``, so the prior's error is exactly ``bias`` everywhere.

sigma^2 modes (V0.5's per-rollout reward variance): ``"worst"`` = ((hi - lo) / 2)^2 (1 for
+-1, 1/4 for 0/1); ``"prior"`` = the Bernoulli variance at the prior,
``(V - lo) * (hi - V)`` (``1 - V^2`` for +-1, ``V (1 - V)`` for 0/1), with the budget
taking the worst case where the test rejected the prior (``trainer.v05.budget_sigma2``).

Cost: the paper's ``c = 0.0039`` per rollout is for +-1 rewards; MSE scales with the range
squared, so the default cost is ``0.0039 * ((hi - lo) / 2)^2`` (``0.0039 / 4`` for 0/1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from anchor_rl.algos import v05
from anchor_rl.methods.v05 import budget_sigma2, sigma2_of

PAPER_COST = 0.0039  # per rollout, +-1 rewards (V0.5 paper)
REWARD_RANGES: dict[str, tuple[float, float]] = {"pm1": (-1.0, 1.0), "binary": (0.0, 1.0)}


def _default_p_grid() -> tuple[float, ...]:
    return tuple(i / 20 for i in range(21))


@dataclass(frozen=True)
class SimConfig:
    """One simulation: a grid of true ``p`` x prior ``bias``, ``trials`` prompts per cell.

    Attributes:
        p_grid: true success probabilities.
        biases: prior errors in probability units (each in ``[0, 0.5]``).
        trials: simulated prompts per (p, bias) cell.
        k_grid: group sizes for the fixed-budget estimators (each in ``[1, k_max]``).
        k_init, k_max: V0.5 budget rule: rollouts before the rule, and the cap.
        reward_form: ``"pm1"`` or ``"binary"``.
        sigma2: ``"worst"`` or ``"prior"`` (see the module docstring).
        cost: per-rollout cost of the budget rule; ``None`` = the paper's, range-scaled.
        seed: seeds the rollout draws.
    """

    p_grid: tuple[float, ...] = field(default_factory=_default_p_grid)
    biases: tuple[float, ...] = (0.0, 0.1, 0.2, 0.4)
    trials: int = 20_000
    k_grid: tuple[int, ...] = (1, 2, 4, 8, 16)
    k_init: int = 4
    k_max: int = 16
    reward_form: Literal["pm1", "binary"] = "pm1"
    sigma2: Literal["worst", "prior"] = "worst"
    cost: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.reward_form not in REWARD_RANGES:
            raise ValueError(f"reward_form must be one of {sorted(REWARD_RANGES)}")
        if self.sigma2 not in ("worst", "prior"):
            raise ValueError(f"sigma2 must be 'worst' or 'prior', got {self.sigma2!r}")
        if not self.p_grid or any(not 0 <= p <= 1 for p in self.p_grid):
            raise ValueError(f"p_grid must be non-empty, within [0, 1]: {self.p_grid}")
        if any(not 0 <= b <= 0.5 for b in self.biases):
            raise ValueError(f"biases must lie in [0, 0.5]: {self.biases}")
        if not 1 <= self.k_init <= self.k_max or any(not 1 <= k <= self.k_max for k in self.k_grid):
            raise ValueError("need 1 <= k_init <= k_max and every k in k_grid within [1, k_max]")
        if self.trials < 2:
            raise ValueError(f"trials must be >= 2, got {self.trials}")

    @property
    def reward_range(self) -> tuple[float, float]:
        return REWARD_RANGES[self.reward_form]

    @property
    def scaled_cost(self) -> float:
        """The budget rule's per-rollout cost in this reward form's units."""
        if self.cost is not None:
            return self.cost
        lo, hi = self.reward_range
        return PAPER_COST * ((hi - lo) / 2) ** 2


@dataclass
class SimResult:
    """Per-estimator tensors indexed ``[bias, p]`` (float64).

    ``mse``: mean squared error against ``mu``; ``se``: its Monte-Carlo standard error;
    ``rollouts``: mean rollouts used per prompt.
    """

    config: SimConfig
    mse: dict[str, Tensor]
    se: dict[str, Tensor]
    rollouts: dict[str, Tensor]


def prior_values(p: Tensor, bias: float) -> Tensor:
    """The prior's success probability: ``p - bias``, or ``p + bias`` where that is below 0."""
    return torch.where(p - bias >= 0, p - bias, p + bias)


def simulate(cfg: SimConfig) -> SimResult:
    """Run every estimator on every (bias, p) cell; vectorised over cells and trials."""
    lo, hi = cfg.reward_range
    g = torch.Generator().manual_seed(cfg.seed)
    p = torch.tensor(cfg.p_grid, dtype=torch.float64)  # [n_p]
    n_p, n_t = p.numel(), cfg.trials
    success = torch.rand(n_p, n_t, cfg.k_max, generator=g, dtype=torch.float64) < p[:, None, None]
    rewards = lo + (hi - lo) * success.to(torch.float64)  # [n_p, T, k_max]
    mu = (lo + (hi - lo) * p)[:, None]  # [n_p, 1]
    csum = rewards.cumsum(-1)  # csum[..., k-1] = sum of the first k rollouts
    flat_mu = mu.expand(n_p, n_t).reshape(-1)

    cells: dict[str, list[tuple[Tensor, Tensor, Tensor]]] = {}

    def record(name: str, sq_err: Tensor, used: Tensor | float) -> None:
        """Store the MSE, its standard error and the mean rollouts of one bias row."""
        sq = sq_err.reshape(n_p, n_t)
        used = torch.as_tensor(used, dtype=torch.float64).expand(n_p * n_t).reshape(n_p, n_t)
        stats = (sq.mean(1), sq.std(1) / n_t**0.5, used.mean(1))
        cells.setdefault(name, []).append(stats)

    for bias in cfg.biases:
        v_p = prior_values(p, bias)  # prior success probability [n_p]
        prior = (lo + (hi - lo) * v_p)[:, None].expand(n_p, n_t).reshape(-1)
        sigma2 = sigma2_of(prior, cfg.sigma2, cfg.reward_range)
        for k in cfg.k_grid:
            emp = (csum[..., k - 1] / k).reshape(-1)
            ks = torch.full_like(emp, k)
            record(f"group_mean_k{k}", (emp - flat_mu).square(), k)
            if k >= 2:  # leave-one-out: (S - r_i) / (k - 1) for each sample i
                loo = (csum[..., k - 1 : k] - rewards[..., :k]) / (k - 1)
                record(f"loo_k{k}", (loo - mu[..., None]).square().mean(-1), k)
            fused, _, _ = v05.fuse(emp, ks, prior, sigma2)
            record(f"v05_k{k}", (fused - flat_mu).square(), k)
        record("anchor", (prior - flat_mu).square(), 0)
        k0 = torch.full((n_p * n_t,), cfg.k_init, dtype=torch.long)
        emp0 = (csum[..., cfg.k_init - 1] / cfg.k_init).reshape(-1)
        _, _, rejected = v05.fuse(emp0, k0, prior, sigma2)
        budget = budget_sigma2(prior, rejected, cfg.sigma2, cfg.reward_range)
        extra = v05.extra_rollouts(emp0, k0, prior, budget, cfg.scaled_cost, cfg.k_max)
        n = (k0 + extra).clamp(max=cfg.k_max)
        emp = csum.reshape(n_p * n_t, cfg.k_max).gather(1, (n - 1)[:, None])[:, 0] / n
        fused, _, _ = v05.fuse(emp, n, prior, sigma2)
        record("v05_adaptive", (fused - flat_mu).square(), n.to(torch.float64))
        record("oracle", torch.zeros_like(flat_mu), 0)

    def stack(i: int) -> dict[str, Tensor]:
        return {name: torch.stack([row[i] for row in rows]) for name, rows in cells.items()}

    return SimResult(cfg, mse=stack(0), se=stack(1), rollouts=stack(2))
