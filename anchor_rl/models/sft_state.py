"""An interrupted SFT run's state, so that the same command continues it where it stopped.

SFT saves it when SIGTERM or Ctrl-C stops it (:mod:`anchor_rl.interrupt`), in
``.NAME.partial/sft_state.pt`` beside the run's directory ``NAME`` (the cache entry or
``--out``): the step reached, the weights, AdamW's state, torch's RNG state, the losses so
far and a class stop's evaluations and kept weights. The file is written under a temporary
name and renamed, so a second signal while it is written leaves the previous one (or none),
never a torn one. A run of the same config (the same cache key) continues from it: the
data order is replayed to that step (seeded), so the continued run trains exactly the steps
an uninterrupted one would; a run of another config ignores it. The finished run removes it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from anchor_rl.interrupt import shielded

STATE_FILE = "sft_state.pt"


def partial_dir(path: Path) -> Path:
    """Where the interrupted state of the SFT run that ends in ``path`` is kept."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def save_state(
    where: Path | None,
    key: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    losses: list[float],
    checks: Any | None,
) -> Path | None:
    """Write the state after ``step`` optimiser steps of the run with cache key ``key``
    (``checks``: the class stop's bookkeeping, ``anchor_rl.models.sft_stop.ValidationStop``) in
    ``where``; its path (None: ``where`` is None, nothing is kept)."""
    if where is None:
        return None
    where.mkdir(parents=True, exist_ok=True)
    state = {
        "key": key,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "losses": list(losses),
        "checks": None
        if checks is None
        else {
            "evals": checks.evals,
            "best": checks.best,
            "next": checks.next,
            "best_state": checks.best_state,
        },
    }
    tmp = where / f".{STATE_FILE}.tmp-{os.getpid()}"
    try:
        torch.save(state, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with shielded():
        os.replace(tmp, where / STATE_FILE)
    return where / STATE_FILE


def load_state(
    where: Path | None,
    key: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    checks: Any | None,
) -> tuple[int, list[float]]:
    """Restore the state saved in ``where`` for cache key ``key`` into ``model``,
    ``optimizer``, torch's RNG and ``checks``; ``(step, losses)``, or ``(0, [])`` when there
    is no state of this config there (or it cannot be read: the run then starts over)."""
    file = None if where is None else Path(where) / STATE_FILE
    if file is None or not file.is_file():
        return 0, []
    try:
        state = torch.load(file, weights_only=True)
    except Exception:  # a state from another version: start over rather than fail
        return 0, []
    if state.get("key") != key or (state["checks"] is None) != (checks is None):
        return 0, []
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    if checks is not None:
        for name, value in state["checks"].items():
            setattr(checks, name, value)
    return int(state["step"]), [float(x) for x in state["losses"]]


def drop_state(where: Path) -> None:
    """Remove a finished run's interrupted state."""
    shutil.rmtree(where, ignore_errors=True)


def stop_notice(where: Path | None) -> str:
    """What an SFT run does on its first SIGTERM or Ctrl-C (printed when it comes)."""
    keeps = "saving its state" if where is not None else "keeping nothing"
    return f"ending the SFT step in progress, then {keeps}; a second signal stops at once"


def keep(
    where: Path | None,
    cfg: Any,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    losses: list[float],
    checks: Any | None,
) -> str:
    """Save the state of the run of ``cfg`` (an ``SFTConfig``) stopped after ``step`` steps in
    ``where`` (:func:`save_state`; None: nothing) and say what was kept and how to go on."""
    kept = save_state(where, cfg.key(), step, model, optimizer, losses, checks)
    head = f"stopped at step {step:,} of at most {cfg.steps:,}"
    if kept is None:
        return f"{head}; nothing was kept: it starts over when run again"
    return f"{head}\nkept: its state, {kept}\nthe same command continues it from step {step:,}"


def stop_rule(cfg: Any, start: int = 0) -> str:
    """When an SFT run of ``cfg`` (an ``SFTConfig``) stops, and the step it continues from,
    for the line above its bar."""
    stop = cfg.class_stop
    rule = (
        f"{cfg.steps:,} steps"
        if stop is None
        else f"stops when the validation classes settle (checked every {stop.every} steps "
        f"from step {stop.start:,}: acc=0 below {stop.min_share:.0%} of {stop.val_prompts} "
        f"prompts); at most {cfg.steps:,} steps"
    )
    return rule + (f"; continuing an interrupted run from step {start:,}" if start else "")


def stopped_by(cfg: Any, steps: int, kept: dict[str, Any]) -> str:
    """Why a class-stopped run of ``cfg`` ended after ``steps`` steps, and the step it kept
    (``kept``: what ``class_stop.json`` holds)."""
    last, share = kept["evaluations"][-1], cfg.class_stop.min_share
    why = (
        f"the validation classes settled (acc=0 {last['acc=0']:.2f} < {share:.2f})"
        if steps < cfg.steps
        else "the step budget ran out"
    )
    return f"stopped at step {steps:,} of at most {cfg.steps:,}: {why}; kept step {kept['kept_step']:,}"
