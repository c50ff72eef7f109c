"""``anchor-rl algos-check``: run every estimator and loss on a seeded synthetic batch.

torch and rich are imported inside the command so ``anchor-rl --help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

PROMPTS = 4
RESPONSES = 4
TOKENS = 10
VOCAB = 16
KL_COEF = 0.01
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0
VALUE_CLIP = 0.2
GAE_LAMBDA = 0.95
ADAPTIVE_ALPHA = 0.5  # the batch's responses are <= 10 tokens; VAPO's 0.05 would give lam = 0
V05_SIGMA2, V05_COST, V05_K_MAX = 1.0, 0.0039, 16


def _synthetic_batch(seed: int) -> dict[str, Any]:
    """``PROMPTS x RESPONSES`` ragged responses with 0/1 rewards and token-level tensors."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    B = PROMPTS * RESPONSES
    index = torch.arange(PROMPTS).repeat_interleave(RESPONSES) * 7 + 3  # non-contiguous ids
    success = torch.tensor([0.9, 0.6, 0.3, 0.05]).repeat_interleave(RESPONSES)
    rewards = (torch.rand(B, generator=gen) < success).double()
    lengths = torch.randint(3, TOKENS + 1, (B,), generator=gen)
    mask = (torch.arange(TOKENS) < lengths.unsqueeze(1)).double()
    # response 1 is multi-turn: 2 policy tokens, 2 tokens of tool output, 3 policy tokens
    mask[1] = torch.tensor([1, 1, 0, 0, 1, 1, 1, 0, 0, 0], dtype=torch.float64)
    old_logp = -2.0 * torch.rand(B, TOKENS, generator=gen, dtype=torch.float64)
    logp = old_logp + 0.5 * torch.randn(B, TOKENS, generator=gen, dtype=torch.float64)
    ref_logp = old_logp + 0.2 * torch.randn(B, TOKENS, generator=gen, dtype=torch.float64)
    values = torch.rand(B, TOKENS, generator=gen, dtype=torch.float64)
    old_values = values + 0.3 * torch.randn(B, TOKENS, generator=gen, dtype=torch.float64)
    logits = 3.0 * torch.randn(B, TOKENS, VOCAB, generator=gen, dtype=torch.float64)
    anchor = torch.rand(PROMPTS, generator=gen, dtype=torch.float64)
    prior = 2.0 * torch.rand(PROMPTS, generator=gen, dtype=torch.float64) - 1.0
    return {
        "index": index,
        "rewards": rewards,
        "mask": mask,
        "logp": logp,
        "old_logp": old_logp,
        "ref_logp": ref_logp,
        "values": values,
        "old_values": old_values,
        "logits": logits,
        "anchor": anchor,
        "prior": prior,
    }


def _run_all(batch: dict[str, Any]) -> dict[str, Any]:
    """Every estimator, loss, aggregation mode, KL kind, GAE variant and V0.5 step."""
    import torch

    from anchor_rl.algos import advantages as adv_mod
    from anchor_rl.algos import gae as gae_mod
    from anchor_rl.algos import losses, registry, v05

    rewards, index, mask = batch["rewards"], batch["index"], batch["mask"]
    kl_k1 = losses.kl(batch["logp"], batch["ref_logp"], "k1")
    outcome = adv_mod.outcome_to_token_rewards(rewards, mask)
    inputs = {
        "rewards": rewards,
        "index": index,
        "anchor": batch["anchor"].repeat_interleave(RESPONSES),
        "baseline": batch["anchor"].repeat_interleave(RESPONSES),  # V0.5: the prior, unfused
        "token_rewards": outcome - KL_COEF * kl_k1,
        "dense_rewards": -KL_COEF * kl_k1,
        "mask": mask,
        "gamma": 1.0,
    }
    lengths = mask.sum(-1)

    def per_response(a: torch.Tensor) -> torch.Tensor:
        """Token-level advantages summarised as their mean over the response's tokens."""
        return a if a.dim() == 1 else (a * mask).sum(-1) / lengths.clamp(min=1)

    advantages = {
        name: per_response(registry.compute_advantage(name, **inputs))
        for name, estimator in registry.ESTIMATORS.items()
        if "values" not in estimator.inputs  # the critic's: computed below on outcome rewards
    }
    gae_adv, gae_ret = gae_mod.gae(outcome, batch["values"], mask, 1.0, GAE_LAMBDA)
    adaptive = gae_mod.length_adaptive_lambda(lengths, ADAPTIVE_ALPHA).double()
    gae_adaptive, _ = gae_mod.gae(outcome, batch["values"], mask, 1.0, adaptive)
    advantages["gae"] = per_response(gae_adv)
    advantages["gae_length_adaptive"] = per_response(gae_adaptive)

    policy_args = (batch["logp"], batch["old_logp"], advantages["grpo"], mask, CLIP_LOW, CLIP_HIGH)
    value_args = (batch["values"], batch["old_values"], gae_ret, mask, VALUE_CLIP)
    kl_by_kind = {
        kind: losses.kl(batch["logp"], batch["ref_logp"], kind) for kind in losses.KL_KINDS
    }
    loss_rows: dict[str, dict[str, float]] = {}
    for mode in losses.AGG_MODES:
        row = {
            "policy": float(losses.policy_loss(*policy_args, clip_c=CLIP_C, agg=mode)[0]),
            "value": float(losses.value_loss(*value_args, agg=mode)[0]),
        }
        row.update(
            {f"kl_{kind}": float(losses.agg(kl, mask, mode)) for kind, kl in kl_by_kind.items()}
        )
        loss_rows[mode] = row
    # the per-token metrics do not depend on the aggregation mode
    _, pg_metrics = losses.policy_loss(*policy_args, clip_c=CLIP_C)
    _, vf_metrics = losses.value_loss(*value_args)
    metrics = {key: float(v) for key, v in {**pg_metrics, **vf_metrics}.items()}
    metrics["nll_correct"] = float(losses.nll(batch["logp"], mask, rewards == rewards.max()))
    entropy = losses.entropy_from_logits(batch["logits"])
    metrics["entropy_mean"] = float((entropy * mask).sum() / mask.sum())

    sums = torch.zeros(PROMPTS, dtype=torch.float64).index_add_(
        0, torch.arange(PROMPTS).repeat_interleave(RESPONSES), 2.0 * rewards - 1.0
    )
    k = torch.full((PROMPTS,), RESPONSES, dtype=torch.long)
    emp_mean = sums / k
    baseline, weight, rejected = v05.fuse(emp_mean, k, batch["prior"], V05_SIGMA2)
    v05_rows = {
        "emp_mean": emp_mean,
        "prior": batch["prior"],
        "baseline": baseline,
        "weight": weight,
        "rejected": rejected,
        "est_mse": v05.estimated_mse(emp_mean, k, batch["prior"], V05_SIGMA2),
        "extra": v05.extra_rollouts(emp_mean, k, batch["prior"], V05_SIGMA2, V05_COST, V05_K_MAX),
    }
    return {
        "rewards": rewards.tolist(),
        "lengths": lengths.tolist(),
        "advantages": {name: a.tolist() for name, a in advantages.items()},
        "losses": loss_rows,
        "metrics": metrics,
        "v05": {key: v.tolist() for key, v in v05_rows.items()},
        "settings": {
            "kl_coef": KL_COEF,
            "clip": [CLIP_LOW, CLIP_HIGH, CLIP_C],
            "value_clip": VALUE_CLIP,
            "gae_lambda": GAE_LAMBDA,
            "adaptive_alpha": ADAPTIVE_ALPHA,
            "v05": {"sigma2": V05_SIGMA2, "cost": V05_COST, "k": RESPONSES, "k_max": V05_K_MAX},
        },
    }


def _print(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for p in range(PROMPTS):
        rows = range(p * RESPONSES, (p + 1) * RESPONSES)
        table = Table(title=f"advantages, prompt {p} (token-level: mean over the response)")
        table.add_column("method", no_wrap=True)
        for i in rows:
            reward, length = results["rewards"][i], int(results["lengths"][i])
            table.add_column(f"r={reward:g} l={length}", justify="right")
        for name, values in results["advantages"].items():
            table.add_row(name, *(f"{values[i]:+.3f}" for i in rows))
        console.print(table)

    losses_table = Table(title="losses by aggregation mode (GRPO advantages)")
    losses_table.add_column("agg", no_wrap=True)
    columns = list(next(iter(results["losses"].values())))
    for column in columns:
        losses_table.add_column(column, justify="right")
    for mode, row in results["losses"].items():
        losses_table.add_row(mode, *(f"{row[c]:+.4f}" for c in columns))
    console.print(losses_table)

    metrics_table = Table(title="per-token metrics")
    metrics_table.add_column("metric", no_wrap=True)
    metrics_table.add_column("value", justify="right")
    for key, value in results["metrics"].items():
        metrics_table.add_row(key, f"{value:.4f}")
    console.print(metrics_table)

    s = results["settings"]["v05"]
    v05_table = Table(
        title=f"V0.5 (+-1 rewards, k={s['k']}, sigma2={s['sigma2']}, cost={s['cost']}, k_max={s['k_max']})"
    )
    v05_table.add_column("prompt", justify="right")
    for key in results["v05"]:
        v05_table.add_column(key, justify="right")
    for p in range(PROMPTS):
        cells = []
        for values in results["v05"].values():
            value = values[p]
            cells.append(str(value) if isinstance(value, bool | int) else f"{value:+.3f}")
        v05_table.add_row(str(p), *cells)
    console.print(v05_table)


def algos_check(
    seed: Annotated[int, typer.Option(help="Seed of the synthetic batch.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Also write the results as JSON here.")] = None,
) -> None:
    """Run every advantage estimator, loss, aggregation mode, KL kind, GAE variant and the
    V0.5 fusion/budget on a seeded synthetic batch (4 prompts x 4 responses) and print them."""
    results = _run_all(_synthetic_batch(seed))
    _print(results)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"seed": seed, **results}, indent=2))
        typer.echo(f"wrote {out}")
