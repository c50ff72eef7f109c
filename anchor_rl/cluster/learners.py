"""Data-parallel learners (``cluster.learners = N > 1``): the policy and critic updates on N ranks.

This process is rank 0: it runs the loop and holds the run's policy, optimiser and
checkpoints. Ranks 1..N-1 are processes it spawns, each with a replica of the policy and
its optimiser, joined by a torch.distributed process group (gloo on the CPU; on CUDA NCCL,
one GPU per rank: ``data_parallel.placement``, the only place the two differ). For every update
rank 0 broadcasts the step's batch and mini-batch schedule; every rank then runs
``update.ppo_update`` on its share of each mini-batch (``data_parallel.DataParallel``)
through a ``DistributedDataParallel`` replica, whose backward sums the gradients over the
ranks, so the ranks take identical steps and rank 0's weights are what one process would
have computed, up to float summation order. With a critic (PPO, VAPO) every rank also holds
a critic replica and runs its share of the value update the same way (``critic_update``;
``fit_values`` with ``dp``). A LoRA run's ranks inject the same adapters as rank 0 (its
``lora`` section, a ``lora.config_file`` as rank 0 read it) and load rank 0's tensors; DDP
then holds and sums the gradients of the adapters alone. Checkpoints are rank 0's (a consolidated state), so a run
resumes on any number of learners. A rank that dies ends the run with a clear error naming
it, its exit code and its error (also while the ranks start: :func:`_await_joining`,
``RENDEZVOUS``); its last checkpoint resumes it. A divergence (``NonFiniteError``) is raised
by rank 0 alone, with the run's message; the other ranks skip the step and wait for rank
0's stop (:func:`_learner`).

With ``cluster.learner_sharding = "fsdp"`` every rank, rank 0 included, trains an FSDP2
shard of the policy (``data_parallel.shard_model``) with its own shard of the AdamW state.
Each rank builds its copy on the meta device, shards it, and loads its shards of rank 0's
weights and optimiser state, which rank 0 broadcasts one tensor at a time
(:mod:`anchor_rl.cluster.shards`): ranks 1..N-1 never hold the whole model.
Rank 0 keeps the run's whole policy beside its shard, for the rollouts, the scoring and
the checkpoints: after each update the ranks gather the new weights into it, and before a
checkpoint (:meth:`LearnerGroup.consolidate`) the optimiser state into the run's
optimiser, so a checkpoint is the same consolidated state as without sharding. A critic
(``critic.mode = "separate"``) is sharded the same way, beside the policy: every rank trains
a shard of it, and rank 0 gathers its weights into the run's critic after each critic
update and its AdamW state before each checkpoint. A LoRA run's shards split the frozen base
weights and the adapters alike; the optimisers step the trainable parameters alone, and
rank 0 gathers only those (:func:`full_weights`), so the run's policy keeps its base tensors,
which its reference (``models.lora.lora_base``) shares.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.distributed import distributed_c10d

from anchor_rl.allocator import keep_freed_memory
from anchor_rl.batch import RolloutBatch
from anchor_rl.cluster.data_parallel import DataParallel, placement, shard_model
from anchor_rl.cluster.shards import (
    full_optimizer_state,
    full_weights,
    load_full_optimizer_state,
    load_optimizer_shards,
    load_shards,
    load_weights,
    meta_copy,
    unsaved_buffers,
)
from anchor_rl.errors import AnchorRLError, NonFiniteError
from anchor_rl.models import checkpointing
from anchor_rl.models.critic import Critic
from anchor_rl.models.loading import disable_dropout
from anchor_rl.models.lora import apply_lora, lora_context, trainable_parameters
from anchor_rl.models.value_pretrain import fit_values
from anchor_rl.trainer.config import TrainConfig, build_config
from anchor_rl.trainer.update import make_optimizer, ppo_update

logger = logging.getLogger(__name__)

TIMEOUT = timedelta(minutes=30)
"""How long a rank waits in a collective before giving up (the others are rolling out)."""
RENDEZVOUS = timedelta(minutes=1)
"""How long rank 0 waits in the process group's rendezvous, which it enters once every rank
has signalled that it is joining (its set-up done): a rank that dies in between ends the start
after this, not after ``TIMEOUT`` (the group's collectives then get ``TIMEOUT``)."""
DEATH_GRACE = 5.0
"""Seconds a failed collective waits for the rank that caused it to show as exited, so that
the error names it (a closed connection can come before the process is reaped)."""
ERROR_CHARS = 2000
"""The most characters of a rank's error sent to rank 0 (the whole traceback is printed)."""


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
        critic: tuple[Critic, torch.optim.Optimizer] | None = None,
    ) -> None:
        world = cfg.cluster.learners
        threads = cfg.cluster.threads_per_learner or max(1, torch.get_num_threads())
        address = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")
        table = cfg.model_dump(mode="json")
        lora_file = cfg.lora.file_config  # as rank 0 read it (a resumed run's stored copy)
        joining = [context.Event() for _ in range(1, world)]  # set as each rank joins
        self._errors = context.SimpleQueue()  # (rank, its error) from a rank that raised
        self._reported: dict[int, str] = {}
        self.processes = [
            context.Process(
                target=_learner_main,
                args=(rank, world, address, table, policy.config, threads, joining[rank - 1],
                      self._errors, lora_file),
                daemon=True,
                name=f"anchor-rl-learner-{rank}",
            )
            for rank in range(1, world)
        ]  # fmt: skip
        for process in self.processes:
            process.start()
        try:
            self._start(cfg, policy, optimizer, scheduler, critic, address, joining)
        except RuntimeError as exc:  # gloo or its store: a rank gone, the rendezvous's timeout
            who = self._dead()  # before the others are killed
            self._abandon()
            raise AnchorRLError(
                f"{who} stopped while the learner ranks started ({exc}); the other ranks were "
                "stopped"
                if who
                else f"the learner ranks' start failed ({exc}); the ranks were stopped"
            ) from exc
        except BaseException:  # _await_joining's error (it names the rank), an interrupt
            self._abandon()
            raise

    def _start(
        self,
        cfg: TrainConfig,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        critic: tuple[Critic, torch.optim.Optimizer] | None,
        address: str,
        joining: list[Any],
    ) -> None:
        """Rank 0's part of the start, once the ranks are spawned: wait for every rank's
        signal that it has set itself up (:func:`_await_joining`), join the process group
        with them (the rendezvous bounded by ``RENDEZVOUS``), send them the run's state and
        shard the models when sharding."""
        world = cfg.cluster.learners
        where = placement(cfg.device, 0, world, local_rank=0)
        _await_joining(self.processes, joining, self._rank_errors)
        _use_device(where.device)
        dist.init_process_group(
            where.backend, init_method=address, rank=0, world_size=world, timeout=RENDEZVOUS
        )
        # the collectives' timeout and the store's (a group built later, FSDP's mesh on a
        # machine with CUDA, meets there); torch has no public setters for them
        distributed_c10d._set_pg_timeout(TIMEOUT)
        distributed_c10d._get_default_store().set_timeout(TIMEOUT)
        sharded = cfg.cluster.learner_sharding == "fsdp"
        # replicas get the whole state in this message; shards get what no state dict holds
        # here, and their tensors afterwards, one at a time (_sharded_learner)
        state = _start_state(policy, optimizer, sharded)
        state["scheduler"] = scheduler.state_dict()
        state["critic"] = None if critic is None else _start_state(*critic, sharded)
        dist.broadcast_object_list([state], src=0)
        self.cfg, self.policy, self.optimizer, self.scheduler = cfg, policy, optimizer, scheduler
        self.critic = critic
        self.dp = DataParallel(0, world, sharded, where.device)
        # what the updates train: the run's own policy and critic, or this rank's shards of
        # them, built on the meta device and loaded from them (rank 0 keeps the whole ones
        # for the loop)
        self.trained = (policy, optimizer, scheduler)
        self.trained_critic = critic
        if sharded:
            self.trained = _sharded_learner(
                cfg, meta_copy(policy), state, where.device, (policy, optimizer)
            )
            if critic is not None:
                self.trained_critic = _sharded_critic(
                    cfg, meta_copy(critic[0]), state, where.device, critic
                )

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
            model, optimizer, scheduler = self.trained
            metrics = ppo_update(
                model, optimizer, scheduler, batch, mask, old_logp, ref_logp,
                adv, correct, self.cfg, None, schedule=schedule, dp=self.dp,
            )  # fmt: skip
            if self.dp.sharded:  # the new weights into the run's policy; its schedule's step
                load_weights(self.policy, full_weights(model))
                self.scheduler.load_state_dict(scheduler.state_dict())
            return metrics
        except RuntimeError as exc:
            raise AnchorRLError(self._stopped(exc)) from exc

    def consolidate(self) -> None:
        """Bring the shards' optimiser state into the run's optimiser (before a checkpoint;
        nothing to do for replicas, whose rank 0 optimiser is the run's)."""
        if not self.dp.sharded:
            return
        try:
            dist.broadcast_object_list([("consolidate", None)], src=0)
            model, optimizer, _ = self.trained
            load_full_optimizer_state(
                self.policy, self.optimizer, full_optimizer_state(model, optimizer)
            )
            if self.critic is not None:
                assert self.trained_critic is not None
                load_full_optimizer_state(*self.critic, full_optimizer_state(*self.trained_critic))
        except RuntimeError as exc:
            raise AnchorRLError(self._stopped(exc, "a checkpoint's consolidation")) from exc

    def critic_update(
        self,
        batch: RolloutBatch,
        mask: Tensor,
        old_values: Tensor,
        returns: Tensor,
        schedule: list[Tensor],
    ) -> dict[str, float]:
        """The critic's ``fit_values`` on every rank (:func:`_fit_critic`); the whole batch's
        figures. Tensors ``[B, T]``; ``schedule``: the row indices of each mini-batch."""
        if self.critic is None:
            raise RuntimeError("this learner group was started without the critic")
        payload = {"batch": batch, "mask": mask, "old_values": old_values, "returns": returns,
                   "schedule": schedule}  # fmt: skip
        try:
            dist.broadcast_object_list([("critic", payload)], src=0)
            assert self.trained_critic is not None
            fit = _fit_critic(*self.trained_critic, payload, self.cfg, self.dp)
            if self.dp.sharded:  # the new weights into the run's critic
                load_weights(self.critic[0], full_weights(self.trained_critic[0]))
            return fit
        except RuntimeError as exc:
            raise AnchorRLError(self._stopped(exc, "the critic's update")) from exc

    def _rank_errors(self) -> dict[int, str]:
        """The errors the ranks reported before they exited, by rank (drained from the
        ranks' queue and kept)."""
        while not self._errors.empty():
            rank, error = self._errors.get()
            self._reported[rank] = error
        return self._reported

    def _dead(self) -> str:
        """The ranks that have exited, with their exit codes and errors (:func:`_dead_ranks`),
        for the error of a collective that failed: waits up to ``DEATH_GRACE`` seconds for one
        to show as exited; empty when none has."""
        deadline = time.monotonic() + DEATH_GRACE
        while all(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
            time.sleep(0.05)
        return _dead_ranks(self.processes, self._rank_errors())

    def _stopped(self, exc: Exception, during: str = "the policy update") -> str:
        """The error of a collective that failed (``exc``) during ``during``: who stopped
        (:meth:`_dead`) and how to resume."""
        who = self._dead() or "a learner rank"
        return (
            f"{who} stopped during {during} ({exc}); the run stopped before applying "
            "the step: resume it from its last checkpoint with anchor-rl train --resume RUN_DIR "
            "(any cluster.learners)"
        )

    def _abandon(self) -> None:
        """End a start that failed: kill the ranks (waiting for each) and leave the process
        group if rank 0 had joined it, so that nothing of the start is left behind."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=30)
        if dist.is_initialized():
            dist.destroy_process_group()
        elif not distributed_c10d._world.pg_map:
            # A rendezvous that failed has counted its group all the same, and the count names
            # the next group's keys in the store: a later start in this process would wait
            # for keys its new ranks, counting from 0, never write. destroy_process_group
            # resets the count so; no group is left to destroy here.
            distributed_c10d._world.group_count = 0

    def close(self) -> None:
        """Tell the ranks to stop, wait for them, and leave the process group. A rank that
        died already (the stop cannot reach it) is logged, not raised: close runs as the run
        ends, often over the error that ended it (a rank's death, a divergence), which must
        reach the user rather than the closed connection."""
        try:
            if all(p.is_alive() for p in self.processes):
                dist.broadcast_object_list([("stop", None)], src=0)
        except RuntimeError as exc:  # gloo: a peer's connection closed, or a timeout
            logger.warning("a learner rank did not get the stop message (%s)", exc)
        finally:
            for process in self.processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
            if dist.is_initialized():
                dist.destroy_process_group()


def _dead_ranks(processes: list[Any], errors: dict[int, str]) -> str:
    """The ranks of ``processes`` that have exited, each with its exit code and the error it
    reported (``errors``, by rank), if any: ``"anchor-rl-learner-1 (exit code 1: ...)"``."""
    out = []
    for rank, process in enumerate(processes, start=1):
        if process.exitcode is None:
            continue
        error = errors.get(rank)
        out.append(f"{process.name} (exit code {process.exitcode}{': ' + error if error else ''})")
    return ", ".join(out)


def _await_joining(
    processes: list[Any],
    joining: list[Any],
    errors: Callable[[], dict[int, str]] = dict,
    poll: float = 0.05,
) -> None:
    """Wait until every spawned rank has set itself up and is about to join the process
    group (its event set), so that a rank that dies before (an import or unpickling error in
    the new process, a config or model it cannot build) ends the start at once with its exit
    code and its error (``errors()``: the ranks' reported errors, by rank), instead of rank 0
    waiting for the group's 30-minute timeout. The caller stops the other ranks."""
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while not all(event.is_set() for event in joining):
        if any(p.exitcode is not None for p in processes):
            who = _dead_ranks(processes, errors())
            details = "" if errors() else " (its error is above)"
            raise AnchorRLError(
                f"{who} stopped before joining the learners' process group{details}; "
                "the other ranks were stopped"
            )
        if time.monotonic() > deadline:
            raise AnchorRLError(f"the learner ranks did not start within {TIMEOUT}")
        time.sleep(poll)


def _learner_main(
    rank: int,
    world: int,
    address: str,
    table: dict[str, Any],
    model_config: Any,
    threads: int,
    joining: Any,
    errors: Any,
    lora_file: dict[str, Any] | None = None,
) -> None:
    """A learner rank: a replica of the policy and its optimiser, updated with rank 0
    (``joining``: an event set once the rank has set itself up, just before it joins the
    process group; ``errors``: a queue that gets ``(rank, error)`` when the rank raises, for
    rank 0's message, before the rank exits with its traceback printed; ``lora_file``: the
    PEFT config of rank 0's ``lora.config_file``, None without one)."""
    try:
        _learner(rank, world, address, table, lora_file, model_config, threads, joining)
    except Exception as exc:
        error = " ".join(f"{type(exc).__name__}: {exc}".split())  # on one line
        errors.put((rank, error[:ERROR_CHARS]))
        raise


def _learner(
    rank: int,
    world: int,
    address: str,
    table: dict[str, Any],
    lora_file: dict[str, Any] | None,
    model_config: Any,
    threads: int,
    joining: Any,
) -> None:
    """The rank's work (:func:`_learner_main`). What it can do alone comes before it signals
    rank 0 (the config and its plugins, the model), so that an error there ends the start at
    once (:func:`_await_joining`). A LoRA run's rank injects the same adapters as rank 0 (its
    PEFT config, ``lora_file`` included) and loads rank 0's tensors into them."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    keep_freed_memory()
    with tempfile.TemporaryDirectory() as scratch:  # imports the run's plugins too
        cfg = build_config(table, lora_context(lora_file, scratch))
    where = placement(cfg.device, rank, world, local_rank=rank)  # spawned on this machine
    _use_device(where.device)
    sharded = cfg.cluster.learner_sharding == "fsdp"
    if sharded:  # on the meta device (no storage): this rank never holds the whole model;
        with torch.device("meta"):  # its shards are loaded from rank 0's (_sharded_learner)
            model = apply_lora(AutoModelForCausalLM.from_config(model_config), cfg.lora, cfg.seed)
    else:
        model = AutoModelForCausalLM.from_config(model_config).to(where.device)
        model = apply_lora(model, cfg.lora, cfg.seed)  # rank 0's tensors are loaded below
    if cfg.disable_dropout:
        disable_dropout(model)
    if cfg.optim.activation_checkpointing:
        checkpointing.enable(model)
    joining.set()
    dist.init_process_group(
        where.backend, init_method=address, rank=rank, world_size=world, timeout=TIMEOUT
    )
    received: list[Any] = [None]
    dist.broadcast_object_list(received, src=0)
    state = received[0]
    if not sharded:
        model.load_state_dict(state.pop("weights"))
    value_model = None
    if state["critic"] is not None:  # a replica on this rank's policy (shared mode: its body),
        from anchor_rl.trainer.critic import new_critic  # built before the policy is sharded

        value_model = new_critic(cfg, model)
        if cfg.disable_dropout:
            disable_dropout(value_model)
        if not sharded:
            value_model.load_state_dict(state["critic"].pop("weights"))
    critic = None
    if sharded:  # in rank 0's order: the policy's shard, then the critic's
        model, optimizer, scheduler = _sharded_learner(cfg, model, state, where.device)
        if value_model is not None:
            critic = _sharded_critic(cfg, value_model, state, where.device)
    else:
        optimizer, scheduler = make_optimizer(cfg, trainable_parameters(model))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if value_model is not None:
            from anchor_rl.trainer.critic import critic_optimizer

            value_optimizer = critic_optimizer(cfg, value_model)
            value_optimizer.load_state_dict(state["critic"]["optimizer"])
            critic = (value_model, value_optimizer)
    del received, state  # the start message (a replica's whole optimiser state), loaded
    dp = DataParallel(rank, world, sharded, where.device)
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        kind, payload = message[0]
        if kind == "stop":
            break
        try:
            if kind == "critic":
                assert critic is not None
                _fit_critic(*critic, payload, cfg, dp)
                if sharded:  # rank 0 gathers the new weights
                    full_weights(critic[0])
                continue
            if kind == "consolidate":  # rank 0 gathers the optimiser state
                full_optimizer_state(model, optimizer)
                if critic is not None:
                    full_optimizer_state(*critic)
                continue
            ppo_update(
                model, optimizer, scheduler, payload["batch"], payload["mask"],
                payload["old_logp"], payload["ref_logp"], payload["adv"], payload["correct"],
                cfg, None, schedule=payload["schedule"], dp=dp,
            )  # fmt: skip
            if sharded:  # rank 0 gathers the new weights
                full_weights(model)
        except NonFiniteError:
            # A divergence shows on every rank at the same check (the gradients are
            # all-reduced, the policy update's figures summed over the ranks), so rank 0
            # raises it too and ends the run with its message. This rank neither steps nor
            # dies: dying would close its connections under rank 0, whose stop message would
            # then fail with gloo's "Connection closed by peer" over the real error. It
            # waits for the stop.
            continue
    dist.destroy_process_group()
    # Leave without tearing this rank's objects down. A DDP reducer still holds the process
    # group; freeing it on return destroys the group while gloo's worker thread is still
    # disposing of the last broadcast, and that thread waits for the GIL this one holds in
    # the destructor: a deadlock. Nothing here needs finalising: rank 0 writes every output.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _use_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (NCCL's collectives and
    ``broadcast_object_list`` use it); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _start_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool
) -> dict[str, Any]:
    """What rank 0 sends the ranks of ``model`` and its ``optimizer`` as they start: for
    replicas their whole state dicts; for shards only the buffers no state dict holds (e.g.
    rotary frequency tables: :func:`unsaved_buffers`) and whether the optimiser has state,
    the tensors following one at a time as the shards load (:func:`load_shards`)."""
    if not sharded:
        return {
            "weights": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
        }
    return {"buffers": unsaved_buffers(model), "optimizer": bool(optimizer.state)}


def _sharded_learner(
    cfg: TrainConfig,
    model: torch.nn.Module,
    state: dict[str, Any],
    device: torch.device,
    whole: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """This rank's FSDP2 shard of ``model`` (the policy, built on the meta device) on
    ``device``, loaded with rank 0's weights, with its AdamW shard (rank 0's state, by
    parameter name) and schedule (``state``: rank 0's start message, :func:`_start_state`;
    ``whole``: on rank 0, the run's policy and optimiser). Collective."""
    shard_model(model, cfg.cluster.learners, device)
    load_shards(model, device, state["buffers"], None if whole is None else whole[0])
    optimizer, scheduler = make_optimizer(cfg, trainable_parameters(model))
    load_optimizer_shards(model, optimizer, state["optimizer"], whole)
    scheduler.load_state_dict(state["scheduler"])
    return model, optimizer, scheduler


def _sharded_critic(
    cfg: TrainConfig,
    critic: Critic,
    state: dict[str, Any],
    device: torch.device,
    whole: tuple[Critic, torch.optim.Optimizer] | None = None,
) -> tuple[Critic, torch.optim.Optimizer]:
    """This rank's FSDP2 shard of ``critic`` (a separate critic, built on the meta device) on
    ``device``, loaded with rank 0's weights, with its AdamW shard, as
    :func:`_sharded_learner` (``state["critic"]``; ``whole``: on rank 0, the run's critic and
    its optimiser). Collective."""
    from anchor_rl.trainer.critic import critic_optimizer

    critic.shared_prefix = False  # the shared-prefix forward calls parts of FSDP's units
    shard_model(critic, cfg.cluster.learners, device)
    sent = state["critic"]
    load_shards(critic, device, sent["buffers"], None if whole is None else whole[0])
    optimizer = critic_optimizer(cfg, critic)
    load_optimizer_shards(critic, optimizer, sent["optimizer"], whole)
    return critic, optimizer


def _fit_critic(
    critic: Critic,
    optimizer: torch.optim.Optimizer,
    payload: dict[str, Any],
    cfg: TrainConfig,
    dp: DataParallel,
) -> dict[str, float]:
    """``fit_values`` of this rank's share of the critic's update (the same call on every rank;
    its non-finite check is collective, so the ranks stop together)."""
    critic.train()
    return fit_values(
        critic, optimizer, payload["batch"], payload["mask"], payload["old_values"],
        payload["returns"], payload["schedule"], value_clip=cfg.critic.value_clip,
        micro_batch=cfg.optim.micro_batch_size, max_grad_norm=cfg.optim.grad_clip, dp=dp,
    )  # fmt: skip
