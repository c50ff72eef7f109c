"""What an FSDP learner rank holds while it starts (``cluster.learners = 2``,
``cluster.learner_sharding = "fsdp"``, gloo on the CPU): the peak bytes of live tensors and the
peak resident memory of rank 1 from its spawn until its shards of the policy (and critic) are
loaded and their optimisers built, and rank 0's peak live tensor bytes above what it held
before it started the group.

    OMP_NUM_THREADS=1 python benchmarks/fsdp_rank_memory.py --size base
    python benchmarks/fsdp_rank_memory.py --size base --critic --lora-rank 8

Rank 0 builds what a run builds (``models.factory.build_model``, seed 0; ``--lora-rank``: the
``lora`` section's adapters; ``--critic``: the ``ppo`` preset's separate critic and its AdamW)
and starts a :class:`anchor_rl.cluster.learners.LearnerGroup`, then closes it. Rank 1 runs the
learners' own rank code under :class:`LocalBytes` (``benchmarks/activation_memory.py``'s
``LiveBytes``: every tensor storage an operation creates, counted until it is freed, a DTensor
by its local tensor; tensors unpickled from a broadcast object are made without an operation
and are not counted, so ``rss`` is reported beside it). ``rss_base`` is rank 1's resident memory once torch, transformers and anchor_rl are
imported, before anything is built; ``rss_peak`` its peak (``ru_maxrss``) when set up.
``whole_bytes``: the bytes of the policy's (and critic's) parameters and buffers, each storage
once. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
from pathlib import Path
from typing import Any

import torch
from activation_memory import LiveBytes
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from anchor_rl.cluster import learners
from anchor_rl.models.factory import build_model
from anchor_rl.models.lora import apply_lora, trainable_parameters
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.update import make_optimizer

REPORT = "ANCHOR_RL_FSDP_RANK_MEMORY"
"""The environment variable naming the file rank 1 writes its figures to."""


class LocalBytes(LiveBytes):
    """:class:`LiveBytes` that counts a DTensor (a wrapper subclass, whose own storage has the
    whole tensor's size and holds nothing) by the local tensor it wraps."""

    def track(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):
            for name in tensor.__tensor_flatten__()[0]:
                if isinstance(inner := getattr(tensor, name), torch.Tensor):
                    self.track(inner)
        else:
            super().track(tensor)


def _rss() -> int:
    """This process's resident bytes now (Linux ``/proc``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def measured_rank(*args: Any) -> None:
    """``learners._learner_main`` under :class:`LiveBytes`; writes the rank's figures to the
    file ``$ANCHOR_RL_FSDP_RANK_MEMORY`` names once the rank is set up (when it builds its
    ``DataParallel``, the last step of the set-up)."""
    import transformers  # noqa: F401  (imported before the baseline, as the rank's code does)

    base = _rss()
    counter = LocalBytes()
    real = learners.DataParallel

    def report(*dp_args: Any) -> Any:
        figures = {
            "live_peak": counter.peak,
            "live_end": counter.live,
            "rss_base": base,
            "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        Path(os.environ[REPORT]).write_text(json.dumps(figures))
        return real(*dp_args)

    learners.DataParallel = report
    with counter:
        learners._learner_main(*args)


def whole_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers of ``modules``, each storage once."""
    seen: dict[int, int] = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="base")
    parser.add_argument("--critic", action="store_true", help="a separate critic too (ppo)")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank")
    args = parser.parse_args()
    overrides = [f"model=random:{args.size}", "cluster.learners=2", "cluster.threads_per_learner=1",
                 "cluster.learner_sharding=fsdp", "optim.padding_free=off"]  # fmt: skip
    if args.lora_rank:
        overrides.append(f"lora.rank={args.lora_rank}")
    cfg = load_config("ppo" if args.critic else "grpo", overrides)
    policy = apply_lora(build_model(args.size, build_tokenizer(), seed=0), cfg.lora, cfg.seed)
    optimizer, scheduler = make_optimizer(cfg, trainable_parameters(policy))
    critic = None
    modules = [policy]
    if args.critic:
        from anchor_rl.trainer.critic import critic_optimizer, new_critic

        value = new_critic(cfg, policy)
        critic = (value, critic_optimizer(cfg, value))
        modules.append(value)
    learners._learner_main = measured_rank  # the spawned rank's target, looked up here
    counter = LocalBytes()
    counter.add(*modules, optimizer)
    start = counter.live
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[REPORT] = str(Path(tmp) / "rank1.json")
        with counter:
            group = learners.LearnerGroup(cfg, policy, optimizer, scheduler, critic)
        group.close()
        rank1 = json.loads(Path(os.environ[REPORT]).read_text())
    mib = 2**20
    print(json.dumps({
        "size": args.size, "critic": args.critic, "lora_rank": args.lora_rank,
        "torch": torch.__version__,
        "whole_mib": round(whole_bytes(*modules) / mib, 1),
        "rank1_live_peak_mib": round(rank1["live_peak"] / mib, 1),
        "rank1_live_end_mib": round(rank1["live_end"] / mib, 1),
        "rank1_rss_base_mib": round(rank1["rss_base"] / mib, 1),
        "rank1_rss_peak_mib": round(rank1["rss_peak"] / mib, 1),
        "rank1_rss_peak_above_base_mib": round((rank1["rss_peak"] - rank1["rss_base"]) / mib, 1),
        "rank0_live_peak_above_start_mib": round((counter.peak - start) / mib, 1),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
