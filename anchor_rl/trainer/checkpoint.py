"""Resumable checkpoints: weights, optimizer, scheduler, RNG states, the loop's counters and
every method component's state.

Layout of ``RUN_DIR/checkpoints/step_000042/``::

    policy/         save_pretrained (safetensors) + tokenizer; a LoRA run's adapter only, as a
                    PEFT adapter directory (anchor_rl.models.lora.save_adapter)
    optimizer.pt    optimizer.state_dict()
    scheduler.pt    scheduler.state_dict()
    rng.pt          python, numpy and torch global RNG states and the run's generator's
    state.json      TrainState (step, data cursor, cumulative counters) and the format
    NAME.pt         each component's state_dict() (``critic.pt``, ``pvpo.pt``, ``v05.pt``...)
    async_prefetch.pt  asynchronous runs: the prefetched rollouts of the next steps
                    (``PrefetchingEngine.state_dict``)

A checkpoint is written to a temporary directory and renamed into place, so a run killed
while saving leaves the previous checkpoint intact; one stopped by a signal while saving
(:mod:`anchor_rl.interrupt`) removes its temporary directory too, and the rename and the
pruning of old checkpoints finish before the stop. Component states hold plain data and
tensors only, and are read back with ``weights_only=True``.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anchor_rl.errors import AnchorRLError
from anchor_rl.interrupt import shielded
from anchor_rl.models.loading import quiet_transformers, save_policy
from anchor_rl.models.lora import is_lora, save_adapter
from anchor_rl.trainer.component import Component
from anchor_rl.trainer.state import TrainState

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.json"
FORMAT = 2
"""Checkpoint layout version (2: component states in ``NAME.pt``). Bump on a layout change."""


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
    components: Mapping[str, Component] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``state.step`` (with each component's state, and each of
    ``extra``'s plain-data states as ``NAME.pt``) and delete all but the newest ``keep``."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{state.step:06d}"
    tmp = root / f".tmp_step_{state.step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        with quiet_transformers():
            save = save_adapter if is_lora(model) else save_policy  # LoRA: the adapter only
            save(model, tokenizer, tmp / "policy")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_states(generator), tmp / "rng.pt")
        (tmp / STATE_FILE).write_text(json.dumps({"format": FORMAT, **asdict(state)}, indent=2))
        for name, component in (components or {}).items():
            torch.save(component.state_dict(), tmp / f"{name}.pt")
        for name, extra_state in (extra or {}).items():
            torch.save(extra_state, tmp / f"{name}.pt")
    except (OSError, RuntimeError) as exc:  # disk full, quota, permissions: no partial files
        shutil.rmtree(tmp, ignore_errors=True)
        previous = list_checkpoints(run_dir)
        kept = f"{previous[-1].name} is intact" if previous else "no earlier checkpoint exists"
        raise AnchorRLError(
            f"cannot write the checkpoint of step {state.step} in {root}: {exc} (disk full?); "
            f"the partial files were removed and {kept}; free space, then --resume {run_dir}"
        ) from exc
    except BaseException:  # a stop (second Ctrl-C, SIGTERM) while writing: no partial files
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with shielded():  # published whole, or not at all
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


def find_checkpoint(run_dir: Path, name: str | None = None) -> Path:
    """The checkpoint ``name`` (``step_000040``) of a run, or its newest; AnchorRLError naming
    the ones there are."""
    if name is None:
        return latest_checkpoint(run_dir)
    found = {p.name: p for p in list_checkpoints(run_dir)}
    if name not in found:
        raise AnchorRLError(
            f"{Path(run_dir) / CHECKPOINTS} has no checkpoint {name!r}; it has "
            f"{', '.join(found) or 'none'}"
        )
    return found[name]


@contextmanager
def readable(path: Path) -> Iterator[None]:
    """Turn an unreadable checkpoint file into an AnchorRLError naming it and offering the
    previous checkpoint of the run when one is there."""
    try:
        yield
    except AnchorRLError:
        raise
    except Exception as exc:  # a truncated or garbled file fails in many ways
        step = path if path.name.startswith("step_") else path.parent
        run_dir = step.parent.parent
        older = [p for p in list_checkpoints(run_dir) if p.name < step.name]
        offer = (
            f"; the previous checkpoint {older[-1].name} is there: "
            f"anchor-rl train --resume {run_dir} --from {older[-1].name}"
            if older
            else "; there is no earlier checkpoint (checkpoint.keep > 1 keeps more)"
        )
        raise AnchorRLError(f"cannot read the checkpoint {path}: {exc}{offer}") from exc


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest checkpoint; FileNotFoundError naming the run directory if there is none."""
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(
            f"no checkpoint in {Path(run_dir) / CHECKPOINTS}; nothing to resume"
        )
    return found[-1]


def load_train_state(path: Path) -> TrainState:
    """The counters stored in a checkpoint directory; ValueError for another layout version."""
    data = json.loads((Path(path) / STATE_FILE).read_text())
    found = data.pop("format", 1)
    if found != FORMAT:
        raise ValueError(
            f"{path} is a checkpoint of layout {found}; this version of anchor-rl reads layout "
            f"{FORMAT} (start the run again, or resume it with the version that wrote it)"
        )
    return TrainState(**data)


def load_components(path: Path, components: Mapping[str, Component]) -> None:
    """Restore each component's state from ``path/NAME.pt``; FileNotFoundError naming the
    file when the checkpoint has none for a component the run has."""
    for name, component in components.items():
        file = Path(path) / f"{name}.pt"
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} missing: the checkpoint holds no state of the run's {name!r} component"
            )
        component.load_state_dict(torch.load(file, weights_only=True))


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
