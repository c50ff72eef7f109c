"""Resumable checkpoints: weights, optimizer, scheduler, RNG states and the loop's counters.

Layout of ``RUN_DIR/checkpoints/step_000042/``::

    policy/         save_pretrained (safetensors) + tokenizer
    optimizer.pt    optimizer.state_dict()
    scheduler.pt    scheduler.state_dict()
    rng.pt          python, numpy and torch global RNG states and the rollout generator's
    state.json      TrainState (step, data cursor, cumulative counters)
    critic/         the critic and its optimiser, when the run has one (PPO, VAPO)
    v05.pt          the V0.5 prior's state (its evidence and context), when the run has one

A checkpoint is written to a temporary directory and renamed into place, so a run killed
while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from anchor_rl.models.loading import save_policy
from anchor_rl.models.spec import quiet_transformers
from anchor_rl.trainer.critic import CRITIC_DIR, CriticState

if TYPE_CHECKING:
    from anchor_rl.trainer.v05 import V05State

CHECKPOINTS = "checkpoints"


@dataclass
class TrainState:
    """The loop's counters: everything besides weights and RNG that a resumed run needs."""

    step: int = 0
    """Steps completed."""
    consumed: int = 0
    """Prompts drawn from the prompt stream (the data cursor)."""
    rollouts: int = 0
    """Responses generated so far, filtered ones included."""
    tokens: int = 0
    """Policy tokens generated so far, filtered ones included."""
    elapsed: float = 0.0
    """Wall-clock seconds spent in completed steps, evaluation and checkpoints."""
    presample_rollouts: int = 0
    """PVPO: reference rollouts the anchors rest on (M per prompt; cached ones included)."""
    refresh_rollouts: int = 0
    """PVPO: rollouts behind the refreshed anchors so far (cached ones included)."""
    anchor_key: str | None = None
    """PVPO: anchor-store digest of the anchors in use (the presample key, then each refresh's)."""
    value_pretrain_rollouts: int = 0
    """VAPO: reference rollouts value pretraining used (cached ones included)."""


def rng_states(generator: torch.Generator) -> dict:
    """Every RNG state the run draws from."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
    }


def set_rng_states(states: dict, generator: torch.Generator) -> None:
    """Restore what :func:`rng_states` captured."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    generator.set_state(states["generator"])


def save_checkpoint(
    run_dir: Path,
    state: TrainState,
    model: torch.nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    generator: torch.Generator,
    keep: int,
    critic: CriticState | None = None,
    v05: V05State | None = None,
) -> Path:
    """Write the checkpoint of ``state.step`` and delete all but the newest ``keep``."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{state.step:06d}"
    tmp = root / f".tmp_step_{state.step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with quiet_transformers():
        save_policy(model, tokenizer, tmp / "policy")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_states(generator), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
    if critic is not None:
        critic.save(tmp / CRITIC_DIR)
    if v05 is not None:
        v05.save(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step_") and p.is_dir())


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest checkpoint; FileNotFoundError naming the run directory if there is none."""
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(
            f"no checkpoint in {Path(run_dir) / CHECKPOINTS}; nothing to resume"
        )
    return found[-1]


def load_train_state(path: Path) -> TrainState:
    """The counters stored in a checkpoint directory."""
    return TrainState(**json.loads((Path(path) / "state.json").read_text()))


def load_training_states(
    path: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    generator: torch.Generator,
) -> None:
    """Restore optimizer, scheduler and RNG states in place (the weights load with the policy)."""
    path = Path(path)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    # Python's and numpy's RNG states are tuples torch's safe unpickler refuses; this file
    # is one the run itself wrote.
    set_rng_states(torch.load(path / "rng.pt", weights_only=False), generator)
