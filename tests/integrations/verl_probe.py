"""A test probe loaded into every process of a ``main_ppo`` launch (verl imports it with
``VERL_USE_EXTERNAL_MODULES=verl_probe``; ``verl_main_ppo.launch(probe=True)`` sets that,
``PYTHONPATH`` and ``ANCHOR_RL_VERL_PROBE``, the folder it writes to). Without
``ANCHOR_RL_VERL_PROBE`` it changes nothing.

It records, as ``torch.save`` files in that folder:

- ``optim_<pid>_<n>.pt`` after every optimizer step of the process (verl's actor and critic
  workers): per parameter, in the optimizer's order, AdamW's ``step``, ``exp_avg`` and
  ``exp_avg_sq`` (local tensors), and the group's ``lr``, ``betas``, ``eps`` and
  ``weight_decay``. Consecutive files let a test replay every optimizer step of a training
  step from a checkpoint.
- ``advantage_<pid>_<n>.pt`` at every advantage stage of the ``anchor_rl`` trainer
  (:meth:`anchor_rl.integrations.verl.method.MethodState.advantage_step`): the
  ``DataProto`` tensors it was given (``token_level_scores``, ``token_level_rewards``,
  ``old_log_probs``, ``ref_log_prob`` and the critic's ``values`` where present,
  ``response_mask``, all ``[B, T]``), the valid-row mask ``[B]``, the ``uid`` of each row,
  the ``advantages[B, T]`` and ``returns[B, T]`` it wrote, verl's ``gamma`` and the method's
  VAPO knobs (``vapo``: ``lam``, ``policy_lam``, ``lam_alpha``, ``lam_min``, ``whiten``).
- ``critic_<pid>_<n>.pt`` at every mini-batch verl's critic worker trains on
  (``TrainingWorker.train_batch`` with verl's ``value_loss``, in the worker's process): what
  the worker received, in its order, as one ``[T_i]`` tensor per row: ``returns`` (the value
  loss's target) and ``response_mask``; and ``last``, whether the mini-batch is the last of
  its training step (verl steps the learning rate there).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch

FOLDER = os.environ.get("ANCHOR_RL_VERL_PROBE")
_count = itertools.count()


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().float().cpu().clone()


def _save(kind: str, record: dict) -> None:
    assert FOLDER is not None
    torch.save(record, Path(FOLDER) / f"{kind}_{os.getpid()}_{next(_count):04d}.pt")


def _after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    (group,) = optimizer.param_groups
    states = [optimizer.state[p] for p in group["params"]]
    _save("optim", {
        "state": [{k: _local(torch.as_tensor(v)) for k, v in s.items()} for s in states],
        "group": {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")},
    })  # fmt: skip


def _rows(t: torch.Tensor) -> list[torch.Tensor]:
    """A ``[B, T_i]`` (jagged nested) or ``[B, T]`` tensor as its rows, detached on the CPU."""
    return [row.detach().float().cpu().clone() for row in t.unbind(0)]


def _hook_critic() -> None:
    import functools

    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import TrainingWorker

    original = TrainingWorker.train_batch

    @functools.wraps(original)  # keeps verl's dispatch attributes
    def train_batch(self, data, *args, **kwargs):  # type: ignore[no-untyped-def]
        loss = getattr(self.loss_fn, "func", self.loss_fn)
        if isinstance(data, TensorDict) and getattr(loss, "__name__", "") == "value_loss":
            last = tu.get(data, key="update_lr_scheduler", default=False)
            _save("critic", {
                "returns": _rows(data["returns"]),
                "response_mask": _rows(data["response_mask"]),
                "last": bool(last),
            })  # fmt: skip
        return original(self, data, *args, **kwargs)

    TrainingWorker.train_batch = train_batch


def _install() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from anchor_rl.integrations.verl.config import select
    from anchor_rl.integrations.verl.method import MethodState

    register_optimizer_step_post_hook(_after_step)
    original = MethodState.advantage_step
    names = ("token_level_scores", "token_level_rewards", "old_log_probs", "ref_log_prob",
             "values", "response_mask")  # fmt: skip
    knobs = ("lam", "policy_lam", "lam_alpha", "lam_min", "whiten")

    def advantage_step(self, data, algo, num_repeat, valid=None):  # type: ignore[no-untyped-def]
        record = {n: _local(data.batch[n]) for n in names if n in data.batch}
        size = data.batch["response_mask"].shape[0]
        record["valid"] = torch.ones(size, dtype=torch.bool) if valid is None else valid.clone()
        record["uid"] = [str(u) for u in data.non_tensor_batch["uid"]]
        metrics = original(self, data, algo, num_repeat, valid)
        record.update({n: _local(data.batch[n]) for n in ("advantages", "returns")
                       if n in data.batch})  # fmt: skip
        record["gamma"] = float(select(algo, "gamma", 1.0))
        record["vapo"] = {k: getattr(self.cfg.vapo, k) for k in knobs}
        _save("advantage", record)
        return metrics

    MethodState.advantage_step = advantage_step
    _hook_critic()


if FOLDER:
    _install()
