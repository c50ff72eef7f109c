"""Torch intra-op threads per phase of the work, chosen for speed unless the user sets them.

Three phases run torch on the CPU: ``generate`` (sampling: decode steps of a few dozen rows,
many small kernels), ``update`` (log-probs and the forward/backward/optimizer pass over a
whole step's tokens) and ``sft`` (supervised steps of the warm start). For the project's
small models a second OpenMP thread buys little on an idle machine and costs 5-30x on a
machine whose cores are busy with other processes: every parallel region waits for the
thread the scheduler has not run yet. The ``auto`` setting gives each phase one thread below
a size where the extra threads pay for themselves even on a shared machine, and the cores
this process may use above it (docs/models.md, "Threads"; measured by
``benchmarks/threads.py``).

Precedence, highest first: the setting a command or run gives (``threads=N`` in the training
config, ``--threads N`` on ``sft``/``eval``), then ``$OMP_NUM_THREADS``, then ``auto``.

A process opts in with :func:`configure`; until then :func:`phase` changes nothing, so a
library user's, a test's or a Ray worker's own ``torch.set_num_threads`` stands.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Phase = Literal["generate", "update", "sft"]
PHASES: tuple[Phase, ...] = ("generate", "update", "sft")
Setting = Literal["auto"] | int

ONE_THREAD_BELOW: dict[Phase, int] = {
    "generate": 30_000_000,
    "update": 30_000_000,
    "sft": 30_000_000,
}
"""Parameters below which ``auto`` gives a phase one thread (``tiny`` has 1.1M parameters,
``small`` 10.5M, ``base`` 50.4M)."""

OVERRIDE_HINT = "set threads=N or OMP_NUM_THREADS to override"

_setting: Setting | None = None


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op threads of each phase, where they came from and why."""

    generate: int
    update: int
    sft: int
    source: Literal["auto", "setting", "OMP_NUM_THREADS"]
    reason: str
    """Why ``auto`` chose them (the model's size, the machine's cores), or the setting named."""

    def count(self, phase: Phase) -> int:
        """The threads of ``phase``."""
        return {"generate": self.generate, "update": self.update, "sft": self.sft}[phase]

    def line(self, phases: tuple[Phase, ...] = ("generate", "update")) -> str:
        """One log line: ``threads: 1 (tiny model; set threads=N or OMP_NUM_THREADS to
        override)``, or each phase's count where they differ."""
        counts = {p: self.count(p) for p in phases}
        if len(set(counts.values())) == 1:
            shown = str(next(iter(counts.values())))
        else:
            shown = ", ".join(f"{p} {n}" for p, n in counts.items())
        hint = f"; {OVERRIDE_HINT}" if self.source == "auto" else ""
        return f"threads: {shown} ({self.reason}{hint})"


def parse_setting(value: str | int | None) -> Setting:
    """``"auto"`` (also for None) or a thread count >= 1; ValueError for anything else."""
    if value is None or value == "auto":
        return "auto"
    if isinstance(value, bool):
        raise ValueError(f"threads must be auto or a whole number >= 1, got {value!r}")
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"threads must be auto or a whole number >= 1, got {value!r}") from None
    if count < 1 or str(value).strip() not in (str(count), f"{count}.0"):
        raise ValueError(f"threads must be auto or a whole number >= 1, got {value!r}")
    return count


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota
    (``cpu.max`` of a container), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def size_name(parameters: int) -> str:
    """How a log line names a model of ``parameters``: the nearest built-in size below it."""
    if parameters < 5_000_000:
        return "tiny model"
    if parameters < ONE_THREAD_BELOW["generate"]:
        return "small model"
    return f"{parameters / 1e6:.0f}M-parameter model"


def choose_threads(
    parameters: int | None,
    setting: Setting | str | None = "auto",
    cores: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ThreadChoice:
    """Each phase's threads for a model of ``parameters`` (None: unknown, as a command
    that has not loaded its model yet): ``setting`` when it is a count, else
    ``$OMP_NUM_THREADS`` when set to a count, else ``auto``: one thread for a phase below
    its size in :data:`ONE_THREAD_BELOW`, all ``cores`` (default: :func:`available_cores`)
    above it or for an unknown size."""
    setting = parse_setting(setting)
    environ = os.environ if environ is None else environ
    if setting != "auto":
        return ThreadChoice(setting, setting, setting, "setting", f"threads={setting}")
    env = environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        n = int(env)
        return ThreadChoice(n, n, n, "OMP_NUM_THREADS", f"OMP_NUM_THREADS={n}")
    cores = available_cores() if cores is None else max(1, cores)
    if parameters is None:
        return ThreadChoice(cores, cores, cores, "auto", f"{cores} cores, model size unknown")
    counts = {p: 1 if parameters < ONE_THREAD_BELOW[p] else cores for p in PHASES}
    why = size_name(parameters) if 1 in counts.values() else f"{cores} cores"
    return ThreadChoice(**counts, source="auto", reason=why)


def configure(setting: Setting | str | None = "auto") -> None:
    """Let :func:`phase` set this process's threads per ``setting`` from now on."""
    global _setting
    _setting = parse_setting(setting)


def configured() -> Setting | None:
    """The setting :func:`configure` gave, or None when the process has not opted in."""
    return _setting


def parameter_count(model: Any) -> int:
    """The parameters of a ``torch.nn.Module``."""
    return sum(p.numel() for p in model.parameters())


def apply(choice: ThreadChoice, phase: Phase) -> None:
    """Set torch's intra-op threads to ``choice``'s count for ``phase``."""
    import torch

    if torch.get_num_threads() != choice.count(phase):
        torch.set_num_threads(choice.count(phase))


def choice_for(model: Any) -> ThreadChoice | None:
    """The choice for ``model`` under the configured setting; None when not configured."""
    if _setting is None:
        return None
    return choose_threads(parameter_count(model), _setting)


@contextmanager
def phase(name: Phase, model: Any) -> Iterator[ThreadChoice | None]:
    """Run the block with the threads of phase ``name`` for ``model`` (a module) and restore
    the count before it afterwards; changes nothing in a process that did not
    :func:`configure`. Yields the choice (None when not configured)."""
    import torch

    choice = choice_for(model)
    if choice is None:
        yield None
        return
    before = torch.get_num_threads()
    apply(choice, name)
    try:
        yield choice
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
