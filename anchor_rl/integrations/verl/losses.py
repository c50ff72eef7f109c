"""VAPO's actor loss in verl: verl's PPO loss plus the NLL of correct responses.

A registered policy loss never sees rewards, so VAPO's positive-example NLL cannot be one.
The ``anchor_rl`` trainer instead writes a per-row weight ``anchor_rl_nll_weight[B]`` (``1 /
share`` on correct responses, 0 elsewhere: :func:`~.method.nll_weights`) next to the
advantages in verl's TransferQueue, and hands the actor workers this loss function
(``set_loss_fn``, as verl's trainer does for its critic). It runs verl's ``ppo_loss`` and adds
``nll_coef`` times anchor-rl's NLL (:func:`anchor_rl.algos.losses.nll`) over the correct
responses, rescaled to verl's global token normaliser.

Shapes: b responses of a micro-batch, T their padded response width.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from anchor_rl.algos.losses import nll
from anchor_rl.integrations.verl.estimators import rescale
from anchor_rl.integrations.verl.method import NLL_WEIGHT

__all__ = ["vapo_actor_loss"]


def _response_mask(data: TensorDict, width: int) -> Tensor:
    """``response_mask`` as a float ``[b, width]`` tensor (right-padded or cut)."""
    mask = data["response_mask"]
    mask = mask.to_padded_tensor(0) if mask.is_nested else mask
    mask = mask.float()
    if mask.shape[1] < width:
        mask = F.pad(mask, (0, width - mask.shape[1]))
    return mask[:, :width]


def vapo_actor_loss(
    config: Any,
    model_output: dict[str, Tensor],
    data: TensorDict,
    dp_group: Any = None,
    *,
    nll_coef: float,
) -> tuple[Tensor, dict[str, Any]]:
    """verl's ``ppo_loss`` plus ``nll_coef`` x the NLL of correct responses: ``(loss, metrics)``.

    ``data[anchor_rl_nll_weight]`` is ``[b]``; the NLL term is anchor-rl's token mean over the
    micro-batch's correct tokens, rescaled like the policy loss (:func:`.estimators.rescale`)
    so that, summed over micro-batches and data-parallel ranks, it is the sum of the correct
    tokens' ``-log pi`` over the mini-batch divided by ``share`` x its token count.
    """
    from verl.utils.metric import AggregationType, Metric

    loss, metrics = ppo_loss(config, model_output, data, dp_group)
    if nll_coef == 0:
        return loss, metrics
    if NLL_WEIGHT not in data:
        raise KeyError(
            f"{NLL_WEIGHT} is missing from the actor's batch: the VAPO loss runs with the "
            "anchor_rl trainer, which writes it with the advantages"
        )
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    mask = _response_mask(data, log_prob.shape[1]).to(log_prob.dtype)
    weight = data[NLL_WEIGHT].to(log_prob.dtype).reshape(-1)
    select = weight > 0
    local = nll(log_prob, mask, select)
    weighted_tokens = (mask.sum(dim=-1) * weight).sum()
    info = dict(getattr(config, "global_batch_info", None) or {})
    term = rescale(local, mask, "token-mean", info, tokens=weighted_tokens)
    if info.get("batch_num_tokens") is None:  # no global counts: this micro-batch's own tokens
        term = local * weighted_tokens / mask.sum().clamp(min=1)
    metrics["actor/anchor_rl/nll_loss"] = Metric(
        value=local.detach(), aggregation=AggregationType.MEAN
    )
    return loss + nll_coef * term, metrics
