"""A gloo rank that runs the learners' critic update (``learners._fit_critic``) on 2 ranks
where one rank's value loss is infinite: the test that the ranks stop together (the
spawned process imports this module by name: the tests' directory is on its path)."""

from __future__ import annotations

import math
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from anchor_rl.batch import RolloutBatch
from anchor_rl.cluster.data_parallel import DataParallel
from anchor_rl.cluster.learners import _fit_critic
from anchor_rl.errors import NonFiniteError
from anchor_rl.models import value_pretrain
from anchor_rl.models.factory import build_model
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.critic import critic_optimizer, new_critic

GROUP_TIMEOUT = timedelta(seconds=60)
"""The ranks' collective timeout: a rank left waiting fails the test, not hangs it."""


def payload() -> dict[str, Any]:
    """5 responses of 1-4 tokens in two mini-batches (rows 0-2, 3-4): the first gives rank 0
    rows 0 and 2, rank 1 row 1."""
    lengths = [4, 1, 3, 2, 4]
    t = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (t - n) for n in lengths])
    ids = (torch.arange(5 * t).reshape(5, t) % 50 + 14) * mask.long()
    batch = RolloutBatch(
        group=torch.tensor([0, 0, 1, 1, 1]), prompt_ids=[[5, 20, 21]] * 5, response_ids=ids,
        attention_mask=mask, loss_mask=mask, logprobs=torch.zeros(5, t), texts=[""] * 5,
        tool_calls=torch.zeros(5, dtype=torch.long), truncated=torch.zeros(5, dtype=torch.bool),
    )  # fmt: skip
    returns = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])[:, None] * mask
    schedule = [torch.tensor([0, 1, 2]), torch.tensor([3, 4])]
    return {"batch": batch, "mask": mask, "old_values": torch.zeros(5, t),
            "returns": returns, "schedule": schedule}  # fmt: skip


def _fit(rank: int, dp: DataParallel, critic: Any, optimizer: Any, cfg: Any) -> str:
    """One critic update on this rank: ``"stepped"`` or the error it raised."""
    try:
        _fit_critic(critic, optimizer, payload(), cfg, dp)
    except NonFiniteError as exc:
        return f"NonFiniteError: {exc}"
    except Exception as exc:  # a desynchronised group: gloo's closed connection, a timeout
        return f"{type(exc).__name__}: {exc}"
    return "stepped"


def _digest(critic: torch.nn.Module) -> list[float]:
    return [float(v.double().sum()) for v in critic.state_dict().values()]


def fit_with_an_infinite_loss(rank: int, world: int, address: str, bad: int, results: Any) -> None:
    """Rank ``rank`` of ``world``: a critic update in which rank ``bad``'s value loss is
    infinite (its gradient the true one, so the summed gradients' norm stays finite on every
    rank), then one in which every loss is finite. Puts ``(rank, first outcome, whether the
    weights moved, second outcome, the weights' digest)`` on ``results``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=address, rank=rank, world_size=world, timeout=GROUP_TIMEOUT
    )
    cfg = load_config("ppo", [f"cluster.learners={world}", "optim.padding_free=off"])
    critic = new_critic(cfg, build_model("tiny", build_tokenizer(), seed=0))
    optimizer = critic_optimizer(cfg, critic)
    dp = DataParallel(rank, world)
    before = _digest(critic)
    real = value_pretrain.value_loss
    if rank == bad:

        def infinite(*args: Any, **kwargs: Any) -> Any:
            loss, metrics = real(*args, **kwargs)
            return loss + math.inf, metrics  # its value infinite, its gradient unchanged

        value_pretrain.value_loss = infinite
    first = _fit(rank, dp, critic, optimizer, cfg)
    moved = _digest(critic) != before
    value_pretrain.value_loss = real
    second = _fit(rank, dp, critic, optimizer, cfg) if first.startswith("NonFinite") else ""
    results.put((rank, first, moved, second, _digest(critic)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not through DDP's teardown (see learners._learner)
