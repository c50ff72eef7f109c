"""Activation checkpointing (``optim.activation_checkpointing``) off and on, on the CPU: the peak
bytes of live tensors during one policy update and one critic (value) update, and their step
time, on the built-in model sizes.

    OMP_NUM_THREADS=1 python benchmarks/activation_memory.py --out DIR          # tiny, small, base
    python benchmarks/activation_memory.py --out DIR --sizes tiny --repeats 1   # a quick check

Each row builds what a run builds (seed 0) and runs the trainer's own update once to warm up,
once under each memory counter and ``--repeats`` times timed (the off and on configurations
alternating step by step, so a busy machine slows both alike):

* ``policy``: a built-in ``LlamaForCausalLM`` (``models.factory.build_model``), with
  checkpointing switched on by :func:`anchor_rl.models.checkpointing.enable` (what
  ``trainer.run`` does), the trainer's optimiser (``update.make_optimizer``) and update
  (``update.ppo_update``, the ``grpo`` preset without a KL term) on a GRPO-shaped batch.
* ``critic``: the ``ppo`` preset's separate critic on the same size's body
  (``trainer.critic.new_critic``, which checkpoints the critic's backbone when the setting is
  on), its AdamW (``critic_optimizer``) and update (``trainer.critic.critic_update``: the
  clipped value loss) on the same batch (old values 0, returns drawn from N(0, 1)).

The batch: ``--prompts`` prompts of ``--prompt-tokens`` random token ids, ``--n`` responses of
``--response-tokens`` tokens each, every response token trained; ``--micro-batch`` rows per
forward/backward (``optim.micro_batch_size``), the scoring layout the run's defaults pick.

Memory is counted from the tensors, each storage once, by two of torch's own tools:

* ``peak_bytes``: the most bytes of live tensor storage at any point of a step, counted by
  :class:`LiveBytes` (a ``TorchDispatchMode`` that follows every storage an operation of the
  forward, the backward or the optimiser creates until it is freed, plus the storages of the
  model's parameters and buffers, the optimiser's state and the batch's tensors, which exist
  before the step); ``start_bytes`` what it counts when the step starts (weights, optimiser
  state, batch: the gradients are freed between steps); ``peak_above_start`` the difference
  (activations, gradients and temporaries).
* ``profiler_peak_above_start``: the running sum of ``torch.profiler``'s CPU allocation and
  free events (``profile_memory=True``) during another step, at its highest: every allocation
  of the CPU allocator, tensor or not; ``profiler_minus_dispatch`` what it counts above
  :class:`LiveBytes` (tensors made without an operation, e.g. the CPU random-number state,
  5,056 bytes, that ``torch.utils.checkpoint`` saves for each checkpointed layer).

``step_seconds``: the median wall seconds of the timed steps (no counter running). Writes
``DIR/activation_memory.json`` and ``DIR/activation_memory.md`` (the table) and prints the table.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lora_memory import grpo_batch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from anchor_rl.models import checkpointing
from anchor_rl.models.factory import SIZES, build_model
from anchor_rl.models.lora import trainable_parameters
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.trainer.config import build_config
from anchor_rl.trainer.critic import critic_optimizer, critic_update, new_critic
from anchor_rl.trainer.update import make_optimizer, ppo_update

KINDS = ("policy", "critic")


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storage, each storage counted once, and their peak, while the mode
    is on: every storage an operation (forward, backward, optimiser) returns is counted from
    then until it is freed (a weak reference's callback), plus the storages of the tensors,
    modules (parameters, gradients, buffers) and optimisers (state) given to :meth:`add`
    before. Storages resized in place (``UntypedStorage.resize_``) keep their first size."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live = self.peak = 0

    def add(self, *objects: Any) -> None:
        """Count what exists already: tensors, modules' parameters, gradients and buffers,
        optimisers' state tensors."""
        for obj in objects:
            if isinstance(obj, torch.nn.Module):
                params = list(obj.parameters())
                self.add(*params, *(p.grad for p in params if p.grad is not None))
                self.add(*obj.buffers())
            elif isinstance(obj, torch.optim.Optimizer):
                self.add(*(v for s in obj.state.values() for v in s.values()))
            elif isinstance(obj, torch.Tensor):
                self.track(obj)

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self.refs:
            return
        nbytes = storage.nbytes()
        self.refs[storage] = weakref.ref(storage, functools.partial(self.free, nbytes))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def free(self, nbytes: int, _ref: Any) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.track(t)
        return out


def peak_memory(step: Callable[[], Any], *existing: Any) -> dict[str, int]:
    """Run ``step`` once under :class:`LiveBytes`: ``peak_bytes`` (the most bytes of live
    tensor storage at any point of the step, counting what ``existing`` holds: the modules,
    optimisers and tensors the step reads), ``start_bytes`` (those when it starts) and
    ``peak_above_start``."""
    counter = LiveBytes()
    counter.add(*existing)
    start = counter.live
    with counter:
        step()
    return {
        "peak_bytes": counter.peak,
        "start_bytes": start,
        "peak_above_start": counter.peak - start,
    }


def profiler_peak_above_start(step: Callable[[], Any]) -> int:
    """Run ``step`` once under ``torch.profiler`` with ``profile_memory=True``: the highest
    running sum of its CPU allocation (+bytes) and free (-bytes) events, in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    cpu = torch.autograd.DeviceType.CPU
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == cpu
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


class Setup:
    """One row: a ``kind`` (policy or critic) of a built-in model size with checkpointing off or on,
    its optimiser and the update's inputs; :meth:`step` runs one update."""

    def __init__(self, kind: str, size: str, on: bool, args: argparse.Namespace):
        tokenizer = build_tokenizer()
        optim = {"activation_checkpointing": on, "micro_batch_size": args.micro_batch}
        policy = build_model(size, tokenizer, seed=0)
        self.batch = grpo_batch(
            len(tokenizer), args.prompts, args.n, args.prompt_tokens, args.response_tokens
        )
        mask = self.batch.loss_mask
        self.kind, self.times = kind, []
        noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
        if kind == "policy":
            self.cfg = build_config(
                {"preset": "grpo", "kl": {"coef": 0.0, "track": False}, "optim": optim}
            )
            if on:
                checkpointing.enable(policy)
            self.model: torch.nn.Module = policy.train()
            self.optimizer, self.scheduler = make_optimizer(self.cfg, trainable_parameters(policy))
            self.old = torch.zeros_like(mask) - 3.0
            self.target = noise  # the advantages
        else:
            self.cfg = build_config(
                {"preset": "ppo", "critic": {"pretrain_steps": 0}, "optim": optim}
            )
            self.model = new_critic(self.cfg, policy)  # checkpointed when the setting is on
            del policy
            self.optimizer = critic_optimizer(self.cfg, self.model)
            self.old = torch.zeros_like(mask)  # old values
            self.target = noise  # returns
        self.checkpointed = checkpointing.is_enabled(self.model)

    def tensors(self) -> list[Any]:
        """What the step reads that exists before it (for :func:`peak_memory`)."""
        b = self.batch
        return [self.model, self.optimizer, b.response_ids, b.attention_mask, b.loss_mask,
                b.logprobs, b.group, self.old, self.target]  # fmt: skip

    def step(self) -> None:
        """One update: ``ppo_update`` (policy) or ``critic_update`` (critic)."""
        b, gen = self.batch, torch.Generator().manual_seed(0)
        if self.kind == "policy":
            correct = torch.zeros(len(b), dtype=torch.bool)
            ppo_update(
                self.model, self.optimizer, self.scheduler, b, b.loss_mask, self.old, None,
                self.target, correct, self.cfg, gen,
            )  # fmt: skip
        else:
            critic_update(
                self.model, self.optimizer, b, b.loss_mask, self.old, self.target, self.cfg, gen
            )  # type: ignore[arg-type]

    def timed_step(self) -> None:
        start = time.perf_counter()
        self.step()
        self.times.append(time.perf_counter() - start)


def measure(kind: str, size: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The off and on rows of one kind and size."""
    setups = {on: Setup(kind, size, on, args) for on in (False, True)}
    rows = {}
    for on, setup in setups.items():
        setup.step()  # warm-up: the optimiser's state exists from here on
        gc.collect()
        rows[on] = peak_memory(setup.step, *setup.tensors())
        gc.collect()
        rows[on]["profiler_peak_above_start"] = profiler_peak_above_start(setup.step)
        rows[on]["profiler_minus_dispatch"] = (
            rows[on]["profiler_peak_above_start"] - rows[on]["peak_above_start"]
        )
    for _ in range(args.repeats):
        for setup in setups.values():
            setup.timed_step()
    out = []
    for on, setup in setups.items():
        params = {p.data_ptr(): p.numel() for p in setup.model.parameters()}
        out.append({
            "kind": kind, "size": size, "checkpointing": on,
            "checkpointed_layers": setup.checkpointed,
            "parameters": sum(params.values()),
            **rows[on],
            "step_seconds": statistics.median(setup.times),
            "step_seconds_all": setup.times,
        })  # fmt: skip
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the rows (off and on side by side per kind and size)."""
    mib = 2**20
    lines = [
        "| model | update | parameters | held at start (MiB) | peak off (MiB) | peak on (MiB) "
        "| above start off / on (MiB) | on / off (above start) | step off (s) | step on (s) "
        "| time on / off | profiler - dispatch off / on (bytes) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    pairs: dict[tuple[str, str], dict[bool, dict]] = {}
    for r in rows:
        pairs.setdefault((r["size"], r["kind"]), {})[r["checkpointing"]] = r
    for (size, kind), pair in pairs.items():
        off, on = pair[False], pair[True]
        lines.append(
            f"| {size} | {kind} | {off['parameters'] / 1e6:.1f}M | {off['start_bytes'] / mib:.1f} "
            f"| {off['peak_bytes'] / mib:.1f} | {on['peak_bytes'] / mib:.1f} "
            f"| {off['peak_above_start'] / mib:.1f} / {on['peak_above_start'] / mib:.1f} "
            f"| {on['peak_above_start'] / off['peak_above_start']:.2f} "
            f"| {off['step_seconds']:.3f} | {on['step_seconds']:.3f} "
            f"| {on['step_seconds'] / off['step_seconds']:.2f} "
            f"| {off['profiler_minus_dispatch']} / {on['profiler_minus_dispatch']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory of the JSON and table")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=192)
    parser.add_argument("--micro-batch", type=int, default=4, help="optim.micro_batch_size")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per row")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers

    result: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_start": os.getloadavg(),
        "rows": [],
    }
    for size in args.sizes:
        for kind in args.kinds:
            started = time.perf_counter()
            result["rows"] += measure(kind, size, args)
            gc.collect()
            print(f"[{time.strftime('%H:%M:%S')}] {size} {kind}: "
                  f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
            result["load_average_end"] = os.getloadavg()
            (args.out / "activation_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(result["rows"])
    (args.out / "activation_memory.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
