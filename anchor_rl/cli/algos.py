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
ASTARPO_BETA = 1e-3  # A*-PO's beta2 (the paper's)
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
        "vstar": batch["anchor"].repeat_interleave(RESPONSES),  # A*-PO: V* stands in
        "ref_log_ratio": ((batch["old_logp"] - batch["ref_logp"]) * mask).sum(-1),
        "beta": ASTARPO_BETA,
        "policy_value": batch["anchor"].repeat_interleave(RESPONSES),  # perfect baseline
    }
    lengths = mask.sum(-1)

    def per_response(a: torch.Tensor) -> torch.Tensor:
        """Token-level advantages summarised as their mean over the response's tokens."""
        return a if a.dim() == 1 else (a * mask).sum(-1) / lengths.clamp(min=1)

    advantages: dict[str, torch.Tensor] = {}
    errors: dict[str, str] = {}
    for name, estimator in registry.ESTIMATORS.items():
        if "values" in estimator.inputs:  # the critic's: computed below on outcome rewards
            continue
        try:
            advantages[name] = per_response(registry.compute_advantage(name, **inputs))
        except Exception as exc:  # a plug-in's bug: reported by the checks, not a traceback
            errors[name] = f"{type(exc).__name__}: {exc}"
    gae_adv, gae_ret = gae_mod.gae(outcome, batch["values"], mask, 1.0, GAE_LAMBDA)
    gae_gap = float(((gae_ret - gae_adv - batch["values"]) * mask).abs().max())
    adaptive = gae_mod.length_adaptive_lambda(lengths, ADAPTIVE_ALPHA).double()
    gae_adaptive, _ = gae_mod.gae(outcome, batch["values"], mask, 1.0, adaptive)
    advantages["gae"] = per_response(gae_adv)
    advantages["gae_length_adaptive"] = per_response(gae_adaptive)

    policy_args = (batch["logp"], batch["old_logp"], advantages["grpo"], mask, CLIP_LOW, CLIP_HIGH)
    value_args = (batch["values"], batch["old_values"], gae_ret, mask, VALUE_CLIP)
    kl_by_kind = {
        kind: losses.kl(batch["logp"], batch["ref_logp"], kind) for kind in losses.KL_KINDS
    }
    policy_losses: dict[str, dict[str, float]] = {}  # every registered one, by agg mode
    for name, fn in registry.POLICY_LOSSES.items():
        try:
            policy_losses[name] = {
                mode: float(fn(*policy_args, clip_c=CLIP_C, agg=mode, norm_const=None)[0])
                for mode in losses.AGG_MODES
            }
        except Exception as exc:
            errors[f"policy loss {name}"] = f"{type(exc).__name__}: {exc}"
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
        "policy_losses": policy_losses,
        "gae_lambda_adaptive": adaptive.tolist(),
        "gae_returns_gap": gae_gap,
        "errors": errors,
        "settings": {
            "kl_coef": KL_COEF,
            "clip": [CLIP_LOW, CLIP_HIGH, CLIP_C],
            "value_clip": VALUE_CLIP,
            "gae_lambda": GAE_LAMBDA,
            "adaptive_alpha": ADAPTIVE_ALPHA,
            "v05": {"sigma2": V05_SIGMA2, "cost": V05_COST, "k": RESPONSES, "k_max": V05_K_MAX},
        },
    }


def _checks(results: dict[str, Any]) -> dict[str, str | None]:
    """Properties every function must have on the batch, ``{check: None if it holds, else
    what was seen}``: each estimator runs and gives finite advantages; an outcome-level one
    ranks a prompt's responses by reward (strictly), and a group-relative one gives 0 to a
    group whose rewards are all equal; GAE's returns are its advantages plus the values and
    the adaptive lambda lies in [0, 1]; every policy loss is finite in every aggregation
    mode, the value loss and the k2/k3 KL are >= 0, clip fractions lie in [0, 1] and the
    entropy is >= 0; V0.5's weight lies in [0, 1], its baseline between the prior and the
    empirical mean, its estimated MSE in [0, sigma2/k] and its extra rollouts in
    [0, k_max - k]."""
    import math

    from anchor_rl.algos import registry

    checks: dict[str, str | None] = {}
    rewards = results["rewards"]
    groups = [range(p * RESPONSES, (p + 1) * RESPONSES) for p in range(PROMPTS)]

    def check(name: str, failure: str | None) -> None:
        checks[name] = failure

    def finite(values: Any) -> bool:
        if isinstance(values, dict):
            return all(finite(v) for v in values.values())
        if isinstance(values, list):
            return all(finite(v) for v in values)
        return math.isfinite(values)

    for name, estimator in registry.ESTIMATORS.items():
        if name in results["errors"]:
            check(f"{name} runs", results["errors"][name])
            continue
        values = results["advantages"].get(name)
        if values is None:
            continue
        check(f"{name} is finite", None if finite(values) else f"advantages {values}")
        if estimator.token_level:
            continue
        misordered = [
            (i, j) for g in groups for i in g for j in g
            if rewards[i] > rewards[j] and not values[i] > values[j]
        ]  # fmt: skip
        check(
            f"{name} ranks a prompt's responses by reward",
            None
            if not misordered
            else "response {} (r={}, A={:+.3f}) not above {} (r={}, A={:+.3f})".format(
                *(x for i in misordered[0] for x in (i, rewards[i], values[i]))
            ),
        )
        uniform = [g for g in groups if len({rewards[i] for i in g}) == 1]
        if "index" in estimator.inputs and uniform:
            nonzero = [i for g in uniform for i in g if values[i] != 0]
            check(
                f"{name} gives 0 to a group of equal rewards",
                None if not nonzero else f"response {nonzero[0]}: A={values[nonzero[0]]:+.3g}",
            )
    gap = results["gae_returns_gap"]
    check("gae returns = advantages + values", None if gap < 1e-9 else f"off by {gap:.3g}")
    adaptive = results["advantages"]["gae_length_adaptive"]
    check("gae_length_adaptive is finite", None if finite(adaptive) else f"advantages {adaptive}")
    lams = results["gae_lambda_adaptive"]
    check(
        "gae length-adaptive lambda in [0, 1]",
        None if all(0 <= x <= 1 for x in lams) else f"lambda {lams}",
    )
    for name, key in ((n, f"policy loss {n}") for n in registry.POLICY_LOSSES):
        if key in results["errors"]:
            check(f"{key} runs", results["errors"][key])
        else:
            by_mode = results["policy_losses"][name]
            check(f"{key} is finite", None if finite(by_mode) else f"losses {by_mode}")
    for mode, row in results["losses"].items():
        bad = [k for k, v in row.items() if not math.isfinite(v)]
        bad += [k for k in ("value", "kl_k2", "kl_k3") if k in row and row[k] < 0]
        check(
            f"{mode}: losses finite, value and k2/k3 KL >= 0",
            None if not bad else ", ".join(f"{k}={row[k]:+.4g}" for k in bad),
        )
    metrics = results["metrics"]
    bad = [k for k, v in metrics.items() if not math.isfinite(v)]
    bad += [k for k, v in metrics.items() if "clipfrac" in k and not 0 <= v <= 1]
    bad += [k for k in ("entropy_mean",) if metrics.get(k, 0) < 0]
    check(
        "metrics finite, clip fractions in [0, 1], entropy >= 0",
        None if not bad else ", ".join(f"{k}={metrics[k]:.4g}" for k in bad),
    )
    v, s = results["v05"], results["settings"]["v05"]
    out_of_range = []
    for p in range(PROMPTS):
        low, high = sorted((v["prior"][p], v["emp_mean"][p]))
        if not 0 <= v["weight"][p] <= 1:
            out_of_range.append(f"prompt {p}: weight {v['weight'][p]:.4g}")
        if not low - 1e-12 <= v["baseline"][p] <= high + 1e-12:
            out_of_range.append(f"prompt {p}: baseline {v['baseline'][p]:+.4g}")
        if not 0 <= v["est_mse"][p] <= s["sigma2"] / s["k"] + 1e-12:
            out_of_range.append(f"prompt {p}: est_mse {v['est_mse'][p]:.4g}")
        if not 0 <= v["extra"][p] <= max(0, s["k_max"] - s["k"]):
            out_of_range.append(f"prompt {p}: extra {v['extra'][p]}")
    check("v05 fusion and budget in range", "; ".join(out_of_range) or None)
    return checks


def verdict(checks: dict[str, str | None]) -> str:
    """The one-line summary of :func:`_checks`: all passed, or which failed."""
    from anchor_rl.algos import losses, registry

    def count(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 'es' if what.endswith('s') else 's'}"

    failed = [name for name, failure in checks.items() if failure is not None]
    if not failed:
        return (
            f"algos-check: all {len(checks)} checks passed "
            f"({count(len(registry.ESTIMATORS), 'estimator')}, "
            f"{count(len(registry.POLICY_LOSSES), 'policy loss')}, "
            f"{count(len(losses.AGG_MODES), 'aggregation mode')}, "
            f"{count(len(losses.KL_KINDS), 'KL kind')}, GAE, V0.5)"
        )
    return f"algos-check: {len(failed)} of {len(checks)} checks FAILED: {'; '.join(failed)}"


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
    V0.5 fusion/budget on a seeded synthetic batch (4 prompts x 4 responses), print them,
    and check the properties each must have (finite values, advantages ranked by reward,
    losses and ranges in bounds).

    The last line is the verdict: all checks passed, or which failed (exit code 1).
    """
    results = _run_all(_synthetic_batch(seed))
    checks = _checks(results)
    _print(results)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"seed": seed, **results, "checks": checks}, indent=2))
        typer.echo(f"wrote {out}")
    for name, failure in checks.items():
        if failure is not None:
            typer.echo(f"FAILED {name}: {failure}")
    typer.echo(verdict(checks))
    if any(failure is not None for failure in checks.values()):
        raise typer.Exit(1)
