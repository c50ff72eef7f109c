"""The policy's AdamW step, PyTorch's default (foreach) implementation against the fused one,
one torch thread.

    OMP_NUM_THREADS=1 python benchmarks/probe_adamw.py random:tiny random:small --repeats 30 \
        --out FILE

The figures behind ``anchor_rl.trainer.update.adamw`` (fused wherever every parameter is a
plain CPU or CUDA tensor; TRL's trainer defaults to the fused one too): for each model
spec, the model's own parameters with random gradients, one optimizer step with either
implementation in turn (alternating, in one process), median milliseconds of ``--repeats``
steps each; and how far the two implementations' weights are apart after ten steps from the
same start (the same arithmetic up to the rounding of the fused kernel).

Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
from _common import probe_cli

from anchor_rl.rollout.spec import load_spec

OPTIONS = {"lr": 1e-4, "betas": (0.9, 0.999), "weight_decay": 0.0}
WAYS = {"foreach": {"foreach": True}, "fused": {"fused": True}}


def step_times(spec: str, repeats: int) -> dict[str, Any]:
    """Median milliseconds of one AdamW step over ``spec``'s parameters, both ways, and the
    largest parameter difference after ten steps of each from the same weights."""
    model, _ = load_spec(spec, "arithmetic", {}, 0, "cpu", progress=False)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    optimizers = {way: torch.optim.AdamW(params, **OPTIONS, **kw) for way, kw in WAYS.items()}
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    with torch.no_grad():
        for i in range(repeats + 2):
            for way in WAYS if i % 2 == 0 else reversed(list(WAYS)):
                start = time.perf_counter()
                optimizers[way].step()
                if i >= 2:  # the first steps allocate the moments
                    times[way].append(time.perf_counter() - start)
    medians = {way: statistics.median(t) * 1000 for way, t in times.items()}
    return {
        "spec": spec,
        "parameters": sum(p.numel() for p in params),
        "step_ms": {way: round(ms, 3) for way, ms in medians.items()},
        "fused / foreach": round(medians["fused"] / medians["foreach"], 3),
        "max_abs_difference_after_10_steps": _difference(model, grads),
    }


def _difference(model: torch.nn.Module, grads: list[torch.Tensor]) -> float:
    """The largest absolute difference between the weights after ten steps of each way."""
    finals = []
    for kw in WAYS.values():
        twin = copy.deepcopy(model)
        params = [p for p in twin.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, **OPTIONS, **kw)
        for _ in range(10):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
        finals.append(torch.cat([p.detach().flatten() for p in params]))
    return float((finals[0] - finals[1]).abs().max())


def main() -> None:
    probe_cli(__doc__, lambda args: {"adamw": [step_times(s, args.repeats) for s in args.specs]})


if __name__ == "__main__":
    main()
