"""Write a randomly initialised Llama-architecture causal LM as a Hugging Face model directory.

Usage: ``python benchmarks/make_hf_model.py OUT [--hidden 2048 --layers 16 --heads 16
--kv-heads 4 --intermediate 5632 --dtype float32 --seed 0 --device cpu]``.

The body has the given shape (the default is TinyLlama-1.1B's width, 16 of its 22 layers:
722M parameters) and the project's own tokenizer, so the directory loads with
``from_pretrained(OUT)`` anywhere (``model=OUT`` in a config, a bench or ``anchor-rl serve``)
and runs the built-in tasks. Nothing is downloaded: the GPU tables of docs/results.md use it as
"a larger HF-format model" on machines without a hub.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from anchor_rl.models.factory import llama_config, num_parameters
from anchor_rl.models.loading import save_policy
from anchor_rl.models.tokenizer import build_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where to initialise (cuda is faster)")
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    config = llama_config(
        tokenizer,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
    )
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    save_policy(model, tokenizer, args.out)
    print(f"{args.out}: {num_parameters(model) / 1e6:.1f}M parameters, {args.dtype}")


if __name__ == "__main__":
    main()
