"""The baseline-MSE probe: inside a V0.5 run, how far each method's baseline is from the truth.

A benchmark component: importing this module registers it as ``v05_probe``, and a V0.5 run
adds it with ``plugins = ["anchor_rl.bench.v05_probe"]``, ``components = ["v05_probe"]``
and its settings (:class:`ProbeSettings`) in ``component_args.v05_probe``.

Shapes: P probe prompts, K = v05.k_max pool rollouts, M = ``truth`` ground-truth
rollouts, H held-out prompts.

Before steps 1, 1 + E, 1 + 2E, ... (E = ``every``) the probe takes a fixed set of P
training prompts (:func:`probe_records`) and samples, with the policy about to be trained
(the one that samples that step's rollouts), K + M rollouts of each. The first K form the
pool every method draws its rollouts from, the other M give the ground truth
``mu = mean(truth)``. Each method's baseline (:func:`methods`) is compared with ``mu``;
because the truth rollouts are independent of the pool, ``E[(b - mu_hat)^2] = MSE(b) +
Var(mu_hat)``, so the reported ``mse`` subtracts the unbiased estimate of ``Var(mu_hat)``
(``mse_raw`` keeps it). The prior is the run's, as that step would use it (before the
step's update).

It also scores priors against ground truth (``anchor_rl.anchors.priors.prior_metrics``):
the run's prior on the probe prompts (M-rollout truth), and on H held-out test prompts
(``heldout_truth`` rollouts each) a knn prior whose context is the probe prompts'
(embedding, truth) pairs under the current policy (V0's "within-policy" setting), and the
run's own prior when it is knn-based.

The probe's samples are seeded by ``(seed, "probe", step, ...)``, apart from training's and
evaluation's, and it never updates the prior, so a run trains identically with or without
it; its rollouts are counted in ``probe/rollouts``, never in the training counters. Each
probe appends one JSON line to ``RUN_DIR/probe.jsonl`` (``anchor_rl.bench.probe`` turns the
file into tables and plots) and returns ``probe/*`` scalars for metrics.jsonl.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, ValidationError
from torch import Tensor

from anchor_rl.anchors.priors import KNNPrior, evaluate_prior, prior_metrics
from anchor_rl.batch import RolloutBatch
from anchor_rl.errors import ConfigError
from anchor_rl.methods.v05 import (
    embed_groups,
    extra_counts,
    fuse_groups,
    uses_anchors,
    uses_embeddings,
)
from anchor_rl.methods.v05_config import V05Config
from anchor_rl.rollout.engine import group_requests
from anchor_rl.section import Section
from anchor_rl.tasks.base import Record
from anchor_rl.trainer.collect import sampling_params, score
from anchor_rl.trainer.component import Component, Setup, register_component
from anchor_rl.trainer.logging import read_jsonl
from anchor_rl.trainer.v05 import V05

PROBE_FILE = "probe.jsonl"


class ProbeSettings(Section):
    """The probe's settings (``component_args.v05_probe.KEY=value``)."""

    every: int = Field(10, gt=0)
    """Probe before steps 1, 1 + E, 1 + 2E, ... (E = this)."""
    prompts: int = Field(32, gt=0)
    """Training prompts in the fixed probe set."""
    truth: int = Field(64, gt=1)
    """Ground-truth rollouts per probe prompt (apart from the k_max the baselines use)."""
    heldout: int = Field(64, ge=0)
    """Held-out (test) prompts on which the knn prior's AUC and calibration are measured; 0
    skips that part."""
    heldout_truth: int = Field(32, gt=1)
    """Ground-truth rollouts per held-out prompt."""


def methods(k: int, k_max: int) -> tuple[str, ...]:
    """The compared baselines, with ``k`` = k_init (``rollout.n``)."""
    return (
        f"group_mean_k{k}",  # GRPO
        f"loo_k{k}",  # RLOO: each sample's mean of the others
        f"group_mean_k{k_max}",  # GRPO / DAPO at k_max
        "anchor",  # PVPO's static anchor (when the run's prior has one)
        "prior",  # the V0.5 prior alone
        f"v05_k{k}",  # V0.5 fusion of k rollouts, no extras
        "v05_adaptive",  # V0.5 with the run's budget rule and top-up rounds
    )


def probe_due(every: int, step: int) -> bool:
    """Whether a probe run every ``every`` steps runs before training step ``step`` (1-based)."""
    return (step - 1) % every == 0


def probe_records(records: Sequence[Record], n: int) -> list[Record]:
    """A fixed set of ``n`` records spread evenly over ``records`` (all when fewer)."""
    if n >= len(records):
        return list(records)
    return [records[i * len(records) // n] for i in range(n)]


def adaptive_counts(pool: Tensor, prior: Tensor, vc: V05Config, k_init: int) -> Tensor:
    """Rollouts ``n[P]`` the run's adaptive budget would use, drawing them in order from
    ``pool[P, K]``: ``k_init``, then up to ``v05.top_up_rounds`` rounds of
    ``algos.v05.extra_rollouts`` on the rollouts so far (as ``trainer.v05.top_up`` does)."""
    n = torch.full((len(pool),), k_init, dtype=torch.long)
    cols = torch.arange(pool.shape[1])
    for _ in range(vc.top_up_rounds):
        taken = cols[None, :] < n[:, None]  # [P, K]
        rows, group = pool[taken], taken.nonzero()[:, 0]
        extra = extra_counts(fuse_groups(rows, group, prior, vc), vc)
        if not bool(extra.any()):
            break
        n = n + extra
    return n


def baseline_errors(
    pool: Tensor,
    truth: Tensor,
    prior: Tensor,
    anchor: Tensor | None,
    vc: V05Config,
    k_init: int,
) -> dict[str, dict[str, float]]:
    """Each method's error against the ground truth, on probe rewards.

    Args:
        pool: ``[P, K]`` rollout rewards the methods draw from, in order (K = v05.k_max).
        truth: ``[P, M]`` independent rollout rewards; ``mu_hat = truth.mean(1)``.
        prior: ``[P]`` the run's prior; anchor: ``[P]`` the static anchor, or None.

    Returns ``{method: {"mse", "mse_raw", "se", "rollouts"}}``: ``mse_raw`` the mean over
    prompts of ``(b - mu_hat)^2`` (for ``loo`` averaged over the group's samples first),
    ``mse`` the same minus the mean of ``Var(mu_hat) = var(truth) / M`` (unbiased), ``se``
    the standard error of ``mse`` over prompts, ``rollouts`` the mean rollouts used.
    """
    pool, truth, prior = pool.double(), truth.double(), prior.double()
    p, k_max = pool.shape
    mu = truth.mean(1)
    noise = truth.var(1) / truth.shape[1]
    k = k_init
    index = torch.arange(p).repeat_interleave(k)
    v05_k = fuse_groups(pool[:, :k].reshape(-1), index, prior, vc).baseline
    n = adaptive_counts(pool, prior, vc, k_init)
    taken = torch.arange(k_max)[None, :] < n[:, None]
    v05_ada = fuse_groups(pool[taken], taken.nonzero()[:, 0], prior, vc).baseline
    loo = (pool[:, :k].sum(1, keepdim=True) - pool[:, :k]) / (k - 1) if k > 1 else None
    sq: dict[str, tuple[Tensor, Tensor | float]] = {
        f"group_mean_k{k}": ((pool[:, :k].mean(1) - mu).square(), float(k)),
        f"group_mean_k{k_max}": ((pool.mean(1) - mu).square(), float(k_max)),
        "prior": ((prior - mu).square(), 0.0),
        f"v05_k{k}": ((v05_k - mu).square(), float(k)),
        "v05_adaptive": ((v05_ada - mu).square(), n.double()),
    }
    if loo is not None:
        sq[f"loo_k{k}"] = ((loo - mu[:, None]).square().mean(1), float(k))
    if anchor is not None:
        sq["anchor"] = ((anchor.double() - mu).square(), 0.0)
    out = {}
    for name in methods(k, k_max):
        if name not in sq:
            continue
        err, used = sq[name]
        corrected = err - noise
        out[name] = {
            "mse": corrected.mean().item(),
            "mse_raw": err.mean().item(),
            "se": (corrected.std() / p**0.5).item() if p > 1 else float("nan"),
            "rollouts": float(torch.as_tensor(used, dtype=torch.float64).mean()),
        }
    return out


@register_component("v05_probe")
class V05Probe(Component):
    """The probe as a component of a V0.5 run: :meth:`before_step` probes when due.

    ``settings``: the fields of :class:`ProbeSettings`. The run's ``v05`` component (built
    before it) supplies the prompts, the prior and the anchors it probes.
    """

    name = "v05_probe"

    def __init__(self, setup: Setup, **settings: Any) -> None:
        try:
            self.settings = ProbeSettings(**settings)
        except ValidationError as exc:
            why = "; ".join(
                f"component_args.v05_probe.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                for e in exc.errors()
            )
            raise ConfigError(why) from None
        v05 = setup.components.get("v05")
        if not isinstance(v05, V05):
            raise ConfigError(
                "the v05_probe component measures V0.5's baselines: it needs "
                "advantage.estimator=v05"
            )
        self.cfg, self.task, self.policy = setup.cfg, setup.task, setup.policy
        self.engine, self.run_dir, self.v05 = setup.engine, setup.run_dir, v05

    def before_step(self, index: int) -> dict[str, float]:
        """Probe before training step ``index`` when due (see the module docstring); ``{}``
        otherwise. Appends the record to ``RUN_DIR/probe.jsonl`` (dropping records of this
        step or later a stopped run left behind) and returns ``probe/*`` scalars."""
        if not probe_due(self.settings.every, index):
            return {}
        return self.probe(index)

    def _sample(
        self, records: Sequence[Record], n: int, step: int, split: str
    ) -> tuple[Tensor, RolloutBatch]:
        """``(rewards[P, n], batch)``: n rollouts of each record with the training settings,
        seeded by ``(seed, "probe", step, split, prompt id, j)``."""
        task, cfg = self.task, self.cfg
        ids = [r.id for r in records]
        requests = group_requests(
            [r.prompt for r in records], ids, n, cfg.seed, "probe", step, split
        )
        batch = self.engine.rollout(
            requests, sampling_params(cfg, task), tools=task.tools or None,
            instruction=task.instruction,
        )  # fmt: skip
        order = torch.argsort(batch.group, stable=True)
        batch = batch.select(order)
        rewards = score(task, batch, records, cfg).rewards
        return rewards.reshape(len(records), n), batch

    def probe(self, step: int) -> dict[str, float]:
        """Probe the baselines before training step ``step`` (see the module docstring)."""
        cfg, state = self.cfg, self.v05
        vc, k_init, started = cfg.v05, cfg.rollout.n, time.perf_counter()
        probe = self.settings
        records = probe_records(state.records, probe.prompts)
        ids = [r.id for r in records]
        rewards, batch = self._sample(records, vc.k_max + probe.truth, step, "train")
        pool, truth = rewards[:, : vc.k_max], rewards[:, vc.k_max :]
        emb = embed_groups(self.policy, batch, len(records))
        prior = state.prior.predict(ids, emb if uses_embeddings(vc) else None)
        anchor = None
        if uses_anchors(vc) and state.anchors is not None:
            anchor = torch.tensor([state.anchors[i] for i in ids])
        record: dict[str, Any] = {
            "step": step,
            "prompts": len(records),
            "k_init": k_init,
            "k_max": vc.k_max,
            "truth_rollouts": probe.truth,
            "methods": baseline_errors(pool, truth, prior, anchor, vc, k_init),
            "prior_probe": _clean(_scored_prior(prior, truth, vc)),
        }
        rollouts = rewards.numel()
        if probe.heldout:
            held, held_rollouts = self._heldout(emb, ids, truth, step)
            record |= held
            rollouts += held_rollouts
        record["rollouts"] = rollouts
        record["seconds"] = time.perf_counter() - started
        total = append_probe(self.run_dir, record)
        out = {f"probe/mse/{name}": m["mse"] for name, m in record["methods"].items()}
        out |= {
            "probe/rollouts": float(rollouts),
            "probe/rollouts_cumulative": float(total),
            "probe/seconds": record["seconds"],
        }
        for key in ("prior_probe", "knn_heldout", "run_prior_heldout"):
            if key in record and record[key]["auc"] is not None:
                out[f"probe/{key}_auc"] = record[key]["auc"]
        return out

    def _heldout(
        self,
        probe_emb: Tensor,
        probe_ids: list[str],
        probe_truth: Tensor,
        step: int,
    ) -> tuple[dict[str, Any], int]:
        """Prior metrics on held-out prompts: a knn over the probe set's truths, and the run's
        prior when it generalises across prompts (knn-based). Returns them and the rollouts."""
        vc, probe = self.cfg.v05, self.settings
        records = self.task.records("test")[: probe.heldout]
        ids = [r.id for r in records]
        rewards, batch = self._sample(records, probe.heldout_truth, step, "test")
        emb = embed_groups(self.policy, batch, len(records))
        true, outcomes = rewards.double().mean(1), list(rewards)
        knn = KNNPrior(
            window=max(vc.knn_window, len(probe_ids)), top_k=vc.knn_top_k,
            temperature=vc.knn_temperature, reward_range=vc.reward_range,
        )  # fmt: skip
        knn.update(probe_ids, list(probe_truth), probe_emb)
        out: dict[str, Any] = {
            "heldout_prompts": len(records),
            "heldout_truth_rollouts": probe.heldout_truth,
            "knn_heldout": _clean(evaluate_prior(knn, ids, true, emb, outcomes)),
        }
        if uses_embeddings(vc):
            prior = self.v05.prior
            out["run_prior_heldout"] = _clean(evaluate_prior(prior, ids, true, emb, outcomes))
        return out, rewards.numel()


def _scored_prior(prior: Tensor, truth: Tensor, vc: V05Config) -> dict[str, float]:
    """``prior_metrics`` of ``prior[P]`` against the truth rollouts ``truth[P, M]``, with the
    normalised means ``pred_mean`` and ``true_mean`` (as ``evaluate_prior`` reports them)."""
    lo, hi = vc.reward_range
    true = truth.double().mean(1)
    out = prior_metrics(prior, true, list(truth), vc.reward_range)
    out["pred_mean"] = float((prior.double().mean() - lo) / (hi - lo))
    out["true_mean"] = float((true.mean() - lo) / (hi - lo))
    return out


def _clean(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """JSON-safe: NaN (an AUC with one class) becomes None."""
    return {k: (None if v != v else v) for k, v in metrics.items()}


def append_probe(run_dir: Path, record: Mapping[str, Any]) -> int:
    """Append ``record`` to ``probe.jsonl`` after dropping records of its step or later;
    returns the probe rollouts of every record kept (the cumulative probe cost)."""
    path = Path(run_dir) / PROBE_FILE
    kept = [r for r in read_probe(run_dir) if r["step"] < record["step"]] + [dict(record)]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return sum(int(r["rollouts"]) for r in kept)


def read_probe(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/probe.jsonl`` (empty when the run never probed)."""
    path = Path(run_dir) / PROBE_FILE
    if not path.is_file():
        return []
    return read_jsonl(path)
