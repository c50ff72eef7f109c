"""LoRA against full fine-tuning: the bytes a policy update holds in parameters, gradients and
optimiser state, and the update's step time, on one random-init Llama-architecture model.

    python benchmarks/lora_memory.py                       # ~0.4B parameters (the default shape)
    python benchmarks/lora_memory.py --layers 4 --hidden 128 --intermediate 512 --heads 4
    python benchmarks/lora_memory.py --rank 16 --repeats 3 --out FILE

For each of full fine-tuning and LoRA (``lora.rank``, every linear layer but the output
layer, ``anchor_rl.models.lora``) the script builds the model (seed 0), the trainer's own
optimiser (``update.make_optimizer`` over ``models.lora.trainable_parameters``), a GRPO-shaped
batch (``--prompts`` prompts of ``--prompt-tokens`` tokens, ``--n`` responses of
``--response-tokens`` tokens each, random ids) and runs the trainer's update
(``update.ppo_update``: the scoring forward in the run's layout, backward, gradient
clipping, AdamW) once to warm up and ``--repeats`` times timed, the two configurations
alternating step by step (so a busy machine slows both alike).

Bytes are counted from the tensors themselves (each storage once: tied embeddings count once),
not from the process's memory: ``parameters`` (every parameter, frozen base weights included),
``gradients`` (every parameter that takes one holds a gradient of its size during the step)
and ``optimizer`` (the tensors of ``optimizer.state``: AdamW's two moments and step counts).
Activations are not counted: they are the same in both (LoRA adds its small ``A x`` products).

Prints JSON (and writes it to ``--out``): both runs' bytes and median step seconds, and the
ratios LoRA / full.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from anchor_rl.batch import RolloutBatch
from anchor_rl.models.factory import llama_config
from anchor_rl.models.lora import apply_lora, trainable_parameters
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.trainer.config import build_config
from anchor_rl.trainer.update import make_optimizer, ppo_update


def grpo_batch(vocab: int, prompts: int, n: int, prompt_tokens: int, response_tokens: int):
    """A RolloutBatch of ``prompts x n`` rows: each prompt's ``n`` responses share it (random
    ids in ``[3, vocab)``, seed 0), every response token a policy token."""
    gen = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(3, vocab, (prompt_tokens,), generator=gen).tolist()
                  for _ in range(prompts)]  # fmt: skip
    rows = prompts * n
    ids = torch.randint(3, vocab, (rows, response_tokens), generator=gen)
    mask = torch.ones(rows, response_tokens)
    return RolloutBatch(
        group=torch.arange(prompts).repeat_interleave(n),
        prompt_ids=[prompt_ids[i // n] for i in range(rows)],
        response_ids=ids,
        attention_mask=mask,
        loss_mask=mask.clone(),
        logprobs=torch.zeros(rows, response_tokens),
        texts=[""] * rows,
        tool_calls=torch.zeros(rows, dtype=torch.long),
        truncated=torch.zeros(rows, dtype=torch.bool),
        pad_id=0,
    )


def tensor_bytes(tensors) -> int:
    """Bytes of ``tensors``, each storage counted once."""
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


class Setup:
    """One configuration (``rank`` 0: full fine-tuning): the model, its optimiser and the
    update's inputs; :meth:`step` runs one update, :meth:`held` counts the bytes."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        from transformers import LlamaForCausalLM

        tokenizer = build_tokenizer()
        shape = dict(
            hidden_size=args.hidden, num_hidden_layers=args.layers,
            intermediate_size=args.intermediate, num_attention_heads=args.heads,
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(llama_config(tokenizer, **shape))
        self.cfg = build_config(
            {"preset": "grpo", "lora": {"rank": rank, "alpha": 2.0 * rank} if rank else {},
             "kl": {"coef": 0.0, "track": False}, "optim": {"lr": 1e-5}}
        )  # fmt: skip
        self.model = apply_lora(model, self.cfg.lora, seed=0).train()
        self.params = trainable_parameters(self.model)
        self.optimizer, self.scheduler = make_optimizer(self.cfg, self.params)
        self.batch = grpo_batch(
            len(tokenizer), args.prompts, args.n, args.prompt_tokens, args.response_tokens
        )
        mask = self.batch.loss_mask
        self.old_logp = torch.zeros_like(mask) - 3.0
        self.adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
        self.times: list[float] = []

    def step(self, timed: bool) -> None:
        """One update (``update.ppo_update``), its wall seconds kept when ``timed``."""
        batch = self.batch
        correct = torch.zeros(len(batch), dtype=torch.bool)
        start = time.perf_counter()
        ppo_update(
            self.model, self.optimizer, self.scheduler, batch, batch.loss_mask, self.old_logp,
            None, self.adv, correct, self.cfg, torch.Generator().manual_seed(0),
        )  # fmt: skip
        if timed:
            self.times.append(time.perf_counter() - start)

    def result(self) -> dict[str, Any]:
        """Parameters, the bytes held after an update, and the median step seconds."""
        grads = [p.grad for p in self.params if p.grad is not None]
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        unique = {p.data_ptr(): p for p in self.model.parameters()}.values()
        held = {
            "parameters": tensor_bytes(self.model.parameters()),
            "gradients": tensor_bytes(grads) if grads else tensor_bytes(self.params),
            "optimizer": tensor_bytes(state),
        }
        return {
            "parameters": sum(p.numel() for p in unique),
            "trainable": sum(p.numel() for p in self.params),
            "bytes": held | {"total": sum(held.values())},
            "step_seconds": statistics.median(self.times),
            "step_seconds_all": self.times,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    setups = {"full": Setup(args, 0), "lora": Setup(args, args.rank)}
    for i in range(args.repeats + 1):  # alternating, so both see the same machine load
        for setup in setups.values():
            setup.step(timed=i > 0)
    result |= {name: setup.result() for name, setup in setups.items()}
    result["lora_over_full"] = {
        "bytes": result["lora"]["bytes"]["total"] / result["full"]["bytes"]["total"],
        "step_seconds": result["lora"]["step_seconds"] / result["full"]["step_seconds"],
    }
    result["torch"] = torch.__version__
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
