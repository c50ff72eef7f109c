"""The state of FSDP2-sharded learners (``cluster.learner_sharding = "fsdp"``,
:mod:`anchor_rl.cluster.learners`): shards built on the meta device and loaded from rank 0's
whole model one tensor at a time, and the whole weights and optimiser state gathered back onto
rank 0.

A rank builds its copy of a model on the meta device (a spawned rank from the model's config;
rank 0 with :func:`meta_copy` of its run's model), shards it (``data_parallel.shard_model``),
then :func:`load_shards` materialises the shards (``to_empty``) and fills them from rank 0's
state dict, which torch.distributed.checkpoint broadcasts one tensor at a time
(``broadcast_from_rank0``): no rank but rank 0 ever holds the whole model, only its shards
and the one whole tensor in flight. The buffers a state dict leaves out (non-persistent ones,
such as rotary frequency tables: :func:`unsaved_buffers`) travel in rank 0's start message
and are copied in after ``to_empty``. The optimiser state follows the same way
(:func:`load_optimizer_shards`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from anchor_rl.errors import AnchorRLError


def unsaved_buffers(model: torch.nn.Module) -> dict[str, Tensor]:
    """``model``'s buffers that its state dict leaves out (non-persistent ones, such as a
    rotary embedding's frequency table), by name, on the CPU."""
    saved = model.state_dict().keys()
    return {n: b.detach().cpu() for n, b in model.named_buffers() if n not in saved}


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no storage):
    its module tree, ties and ``requires_grad`` flags, to shard and then load
    (:func:`load_shards`) without a second whole copy of the weights."""
    memo: dict[int, Any] = {
        id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for p in model.parameters()
    }
    memo |= {id(b): torch.empty_like(b, device="meta") for b in model.buffers()}
    return copy.deepcopy(model, memo)


def load_shards(
    model: torch.nn.Module,
    device: torch.device,
    buffers: dict[str, Tensor],
    whole: torch.nn.Module | None,
) -> None:
    """Materialise the sharded ``model`` (built on the meta device) on ``device`` and load
    rank 0's weights into it: rank 0 (``whole``: its run's model) broadcasts its state dict
    one tensor at a time, of which every rank (``whole`` None) keeps its shard
    (torch.distributed.checkpoint's ``broadcast_from_rank0``), so no rank other than rank 0
    holds more than its shards and one whole tensor; then the ``buffers`` no state dict
    holds (:func:`unsaved_buffers`), which ``to_empty`` left uninitialised. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, whole.state_dict() if whole is not None else {}, options=options)
    with torch.no_grad():
        for name, tensor in buffers.items():
            model.get_buffer(name).copy_(tensor)
    named = [*model.named_parameters(), *model.named_buffers()]
    if left := [name for name, t in named if t.is_meta]:  # not a RuntimeError: no rank stopped
        raise AnchorRLError(f"the sharded model's tensors {left[:3]} were not loaded")


def load_optimizer_shards(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    has_state: bool,
    whole: tuple[torch.nn.Module, torch.optim.Optimizer] | None,
) -> None:
    """Load rank 0's optimiser state (``whole``: its run's model and optimiser; None on the
    other ranks) into the sharded ``model``'s ``optimizer``, broadcast one tensor at a time
    and sharded as the parameters are. Nothing when it has no state (``has_state`` False:
    no step taken), which leaves a fresh optimiser as it is. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not has_state:
        return
    state = full_optimizer_state(*whole) if whole is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optimizer, state, options=options)


def full_weights(model: torch.nn.Module) -> dict[str, Tensor]:
    """The sharded ``model``'s whole state dict, on rank 0's CPU (empty elsewhere). Collective.

    A model with frozen parameters (a LoRA model's base weights) gathers its trainable ones
    alone, by name (the adapters; a critic's head), not its buffers nor frozen weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    named = list(model.named_parameters())
    if all(p.requires_grad for _, p in named):  # the same on every rank
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)
    state = {}
    for name, param in named:  # in the same order on every rank
        if param.requires_grad:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if dist.get_rank() == 0:
                state[name] = full.detach().cpu()
    return state


def load_weights(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` (:func:`full_weights`) into rank 0's whole ``model`` in place; its
    frozen parameters (a LoRA model's base, shared with the reference) stay as they are."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    frozen |= {n for n, _ in model.named_buffers()}  # not gathered either; never trained
    result = model.load_state_dict(state, strict=False)
    missing = [name for name in result.missing_keys if name not in frozen]
    if missing or result.unexpected_keys:  # not a RuntimeError: no rank stopped
        raise AnchorRLError(
            f"the gathered weights do not fit the run's model (missing {missing[:3]}, "
            f"unexpected {list(result.unexpected_keys)[:3]})"
        )


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer``'s whole state keyed by parameter name (a sharded model's: on rank 0's CPU,
    empty elsewhere; collective). An optimiser that has not stepped has no state: returned
    empty as it is (torch.distributed.checkpoint would take a zero step to create one, which
    counts in AdamW's bias correction)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not optimizer.state:  # the same on every rank: the ranks step together
        return {"state": {}, "param_groups": []}

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load a by-name optimiser state (:func:`full_optimizer_state`) into ``optimizer``, of a
    sharded ``model`` (collective) or a whole one; an empty state (no step taken) leaves a
    fresh optimiser as it is."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if state["state"]:
        set_optimizer_state_dict(
            model, optimizer, state, options=StateDictOptions(full_state_dict=True)
        )
