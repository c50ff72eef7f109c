"""benchmarks/lora_memory.py: the bytes held in parameters, gradients and optimiser state with
and without LoRA, counted from the tensors, on a model small enough for a test."""

from __future__ import annotations

import argparse

import lora_memory as bench

SHAPE = dict(hidden=128, layers=2, intermediate=512, heads=4, prompts=2, n=2)
SHAPE |= dict(prompt_tokens=8, response_tokens=8)


def test_lora_holds_the_weights_once_and_trains_only_the_adapters() -> None:
    full = bench.Setup(argparse.Namespace(**SHAPE), 0)
    lora = bench.Setup(argparse.Namespace(**SHAPE), 8)
    for setup in (full, lora):
        setup.step(timed=True)
    a, b = full.result(), lora.result()
    assert a["trainable"] == a["parameters"] and 0 < b["trainable"] < a["parameters"] / 5
    # full: gradients the size of the weights, AdamW two moments of them (and step counts)
    assert a["bytes"]["gradients"] == a["bytes"]["parameters"]
    assert 2 * a["bytes"]["parameters"] <= a["bytes"]["optimizer"] < 2.01 * a["bytes"]["parameters"]
    # LoRA: the frozen weights plus the adapters, gradients and moments of the adapters only
    assert b["bytes"]["gradients"] == 4 * b["trainable"]
    assert b["bytes"]["total"] < 0.4 * a["bytes"]["total"]
    assert len(a["step_seconds_all"]) == len(b["step_seconds_all"]) == 1
