"""Data-parallel learners (``cluster.learners = N > 1``): the policy update on N ranks.

This process is rank 0: it runs the loop and holds the run's policy, optimiser and
checkpoints. Ranks 1..N-1 are processes it spawns, each with a replica of the policy and
its optimiser, joined by a torch.distributed process group (gloo). For every update
rank 0 broadcasts the step's batch and mini-batch schedule; every rank then runs
``update.ppo_update`` on its share of each mini-batch (``distributed.DataParallel``) and
the gradients are summed before each step, so the ranks take identical steps and rank 0's
weights are what one process would have computed, up to float summation order.
Checkpoints are rank 0's (a consolidated state), so a run resumes on any number of
learners. A rank that dies ends the run with a clear error; its last checkpoint resumes it.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from anchor_rl.batch import RolloutBatch
from anchor_rl.errors import AnchorRLError
from anchor_rl.models.loading import disable_dropout
from anchor_rl.trainer.config import TrainConfig, build_config
from anchor_rl.trainer.distributed import DataParallel
from anchor_rl.trainer.update import make_optimizer, ppo_update

TIMEOUT = timedelta(minutes=30)
"""How long a rank waits in a collective before giving up (the others are rolling out)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LearnerGroup:
    """Ranks 1..N-1 beside this process (rank 0); see the module docstring."""

    def __init__(
        self,
        cfg: TrainConfig,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> None:
        world = cfg.cluster.learners
        threads = cfg.cluster.threads_per_learner or max(1, torch.get_num_threads())
        address = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")
        table = cfg.model_dump(mode="json")
        self.processes = [
            context.Process(
                target=_learner_main,
                args=(rank, world, address, table, policy.config, threads),
                daemon=True,
                name=f"anchor-rl-learner-{rank}",
            )
            for rank in range(1, world)
        ]
        for process in self.processes:
            process.start()
        dist.init_process_group(
            "gloo", init_method=address, rank=0, world_size=world, timeout=TIMEOUT
        )
        state = {
            "weights": {k: v.detach().cpu() for k, v in policy.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
        dist.broadcast_object_list([state], src=0)
        self.cfg, self.policy, self.optimizer, self.scheduler = cfg, policy, optimizer, scheduler
        self.dp = DataParallel(0, world)

    def update(
        self,
        batch: RolloutBatch,
        mask: Tensor,
        old_logp: Tensor,
        ref_logp: Tensor | None,
        adv: Tensor,
        correct: Tensor,
        schedule: list[Tensor],
    ) -> dict[str, float]:
        """``update.ppo_update`` on every rank; the averaged metrics of the whole batch.

        Tensors as in ``ppo_update`` (``[B, T]``, ``correct[B]``); ``schedule``: the row
        indices of each mini-batch, in order.
        """
        payload = {
            "batch": batch, "mask": mask, "old_logp": old_logp, "ref_logp": ref_logp,
            "adv": adv, "correct": correct, "schedule": schedule,
        }  # fmt: skip
        try:
            dist.broadcast_object_list([("update", payload)], src=0)
            return ppo_update(
                self.policy, self.optimizer, self.scheduler, batch, mask, old_logp, ref_logp,
                adv, correct, self.cfg, None, schedule=schedule, dp=self.dp,
            )  # fmt: skip
        except RuntimeError as exc:
            raise AnchorRLError(self._stopped(exc)) from exc

    def _stopped(self, exc: Exception) -> str:
        dead = [(p.name, p.exitcode) for p in self.processes if not p.is_alive()]
        who = ", ".join(f"{name} (exit code {code})" for name, code in dead) or "a learner rank"
        return (
            f"{who} stopped during the policy update ({exc}); the run stopped before applying "
            "the step: resume it from its last checkpoint with anchor-rl train --resume RUN_DIR "
            "(any cluster.learners)"
        )

    def close(self) -> None:
        """Tell the ranks to stop, wait for them, and leave the process group."""
        try:
            if all(p.is_alive() for p in self.processes):
                dist.broadcast_object_list([("stop", None)], src=0)
        finally:
            for process in self.processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
            if dist.is_initialized():
                dist.destroy_process_group()


def _learner_main(
    rank: int, world: int, address: str, table: dict[str, Any], model_config: Any, threads: int
) -> None:
    """A learner rank: a replica of the policy and its optimiser, updated with rank 0."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=address, rank=rank, world_size=world, timeout=TIMEOUT
    )
    cfg = build_config(table)  # imports the run's plugins too
    model = AutoModelForCausalLM.from_config(model_config)
    if cfg.disable_dropout:
        disable_dropout(model)
    received: list[Any] = [None]
    dist.broadcast_object_list(received, src=0)
    state = received[0]
    model.load_state_dict(state["weights"])
    optimizer, scheduler = make_optimizer(cfg, model.parameters())
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    dp = DataParallel(rank, world)
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        kind, payload = message[0]
        if kind == "stop":
            break
        ppo_update(
            model, optimizer, scheduler, payload["batch"], payload["mask"], payload["old_logp"],
            payload["ref_logp"], payload["adv"], payload["correct"], cfg, None,
            schedule=payload["schedule"], dp=dp,
        )  # fmt: skip
    dist.destroy_process_group()
