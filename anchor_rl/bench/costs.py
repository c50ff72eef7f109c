"""A small cost model: a run's counts turned into seconds from per-unit costs measured on a
machine (fitted from runs' own ``metrics.jsonl``), so methods that spend their rollouts
differently compare at an equal modelled cost.

The counts a run logs per step (``anchor_rl.trainer.loop``): ``tokens/step`` (generated),
``rollouts/step`` (scored by the reward), ``tokens/scored`` (prompt + response tokens
through a log-prob forward pass before the update: the policy's re-scoring, the
reference's) and ``tokens/updated`` (those tokens times the update's epochs). Modelled
seconds of a step::

    generate_per_token * tokens/step + score_per_rollout * rollouts/step
      + forward_per_token * (tokens/scored + BACKWARD * tokens/updated) + sync_per_step

An update token costs ``BACKWARD`` = 3 forward tokens (forward + backward, the usual
estimate). Rollouts outside the steps (presampling, refreshes, a model teacher, value
pretraining: ``rollouts/total`` minus ``rollouts/cumulative``) are modelled as generation
only, at the run's mean generated tokens per policy rollout: they need no reward call
before training and no update (VAPO's value pretraining does update a critic; the model
leaves that out). Evaluation is left out: it is the same for every method.

:func:`fit_costs` takes each cost as a ratio of sums over the steps of the runs given
(seconds of the phase / its count), so a suite's runs on one machine give that machine's
costs; :class:`Costs` round-trips through JSON (``costs.json``) to apply the costs measured
on another machine (a GPU) to the same counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

BACKWARD = 3.0
"""Forward-token equivalents of one token of the update (its forward and backward)."""
MODELLED = "cost/modelled_s"
"""The key :func:`with_modelled_seconds` adds to each record: cumulative modelled seconds."""


@dataclass(frozen=True)
class Costs:
    """Seconds per unit of work on one machine."""

    generate_per_token: float
    """Seconds per generated token (sampling, batched as the runs batched it)."""
    score_per_rollout: float
    """Seconds per rollout scored by the task's reward."""
    forward_per_token: float
    """Seconds per token of a log-prob forward pass (an update token costs ``BACKWARD``)."""
    sync_per_step: float
    """Seconds per step pushing the weights to the rollout engine."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Costs:
        return cls(**{k: float(data[k]) for k in cls.__dataclass_fields__})


def fit_costs(runs: Sequence[Sequence[Mapping[str, Any]]]) -> Costs:
    """The per-unit costs of the training steps of ``runs`` (each a run's metric records):
    each the ratio of a phase's seconds to its count, summed over every step. ValueError
    when no step logged the token counts (a run from before they were logged)."""
    steps = [r for records in runs for r in records if r["step"] > 0 and "tokens/updated" in r]
    if not steps:
        raise ValueError("no step logged tokens/scored and tokens/updated: nothing to fit")

    def ratio(seconds: str, count) -> float:
        total = sum(count(r) for r in steps)
        return sum(r.get(seconds, 0.0) for r in steps) / total if total else 0.0

    return Costs(
        generate_per_token=ratio("time/generate", lambda r: r["tokens/step"]),
        score_per_rollout=ratio("time/score", lambda r: r["rollouts/step"]),
        forward_per_token=ratio("time/update", forward_tokens),
        sync_per_step=ratio("time/sync", lambda r: 1.0),
    )


def forward_tokens(record: Mapping[str, Any]) -> float:
    """A step's forward-token equivalents: scored tokens plus ``BACKWARD`` x updated ones."""
    return record.get("tokens/scored", 0.0) + BACKWARD * record.get("tokens/updated", 0.0)


def step_seconds(record: Mapping[str, Any], costs: Costs) -> float:
    """The modelled seconds of one training step's record."""
    return (
        costs.generate_per_token * record.get("tokens/step", 0.0)
        + costs.score_per_rollout * record.get("rollouts/step", 0.0)
        + costs.forward_per_token * forward_tokens(record)
        + costs.sync_per_step
    )


def with_modelled_seconds(
    records: Sequence[Mapping[str, Any]], costs: Costs
) -> list[dict[str, Any]]:
    """Copies of a run's records with ``cost/modelled_s``: the modelled seconds of its steps so
    far plus its rollouts outside the steps (:data:`MODELLED`; see the module's model)."""
    last = next((r for r in reversed(records) if "tokens/cumulative" in r), {})
    policy = last.get("rollouts/cumulative", 0.0)
    per_rollout = last.get("tokens/cumulative", 0.0) / policy if policy else 0.0
    out, steps = [], 0.0
    for r in records:
        if r["step"] > 0:
            steps += step_seconds(r, costs)
        extra = r.get("rollouts/total", 0.0) - r.get("rollouts/cumulative", 0.0)
        outside = costs.generate_per_token * per_rollout * max(0.0, extra)
        out.append({**r, MODELLED: steps + outside})
    return out


def cost_figures(records: Sequence[Mapping[str, Any]], costs: Costs) -> dict[str, float]:
    """A run's work counts and modelled seconds: ``generated_tokens``, ``scored_tokens``,
    ``updated_tokens`` (sums over its steps), ``modelled_s``."""
    steps = [r for r in records if r["step"] > 0]
    modelled = with_modelled_seconds(records, costs)
    return {
        "generated_tokens": sum(r.get("tokens/step", 0.0) for r in steps),
        "scored_tokens": sum(r.get("tokens/scored", 0.0) for r in steps),
        "updated_tokens": sum(r.get("tokens/updated", 0.0) for r in steps),
        "modelled_s": modelled[-1][MODELLED] if modelled else 0.0,
    }


COSTS_FILE = "costs.json"
"""A suite directory's per-unit costs measured on another machine: when present, the
suite's summary models seconds with them instead of fitting its own runs."""


def fit_run_dirs(run_dirs: Sequence[Any]) -> Costs:
    """:func:`fit_costs` of the training runs in ``run_dirs`` (their ``metrics.jsonl``)."""
    from anchor_rl.trainer.logging import read_metrics

    return fit_costs([read_metrics(d) for d in run_dirs])


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m anchor_rl.bench.costs RUN_DIR... [--out FILE]``: the per-unit costs fitted
    from the runs' logs, printed as JSON (and written to FILE: a suite directory's
    ``costs.json`` applies them to that suite's counts)."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m anchor_rl.bench.costs")
    parser.add_argument("runs", nargs="+", type=Path, help="training run directories")
    parser.add_argument("--out", type=Path, help="write the costs here as JSON")
    args = parser.parse_args(argv)
    text = json.dumps(fit_run_dirs(args.runs).to_dict(), indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
