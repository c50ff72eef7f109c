"""Scoring with each prompt computed once for all the responses that share it.

A GRPO step scores n responses per prompt, and the padded and packed layouts of
:mod:`anchor_rl.models.scoring` run the prompt through the model once per response. Here
the prompt goes through the layers once per distinct prompt, and every response attends to
its prompt's keys and values, so the prompt's share of the linear layers (the bulk of the
compute) is paid once instead of n times; in the backward pass autograd sums the
responses' gradients into the shared prompt states. The idea is the shared-prefix forward
of "Prefix Grouper" (Liu et al., 2025); the numbers are those of the plain layouts up to
float rounding (pinned in the tests).

Layout (:class:`SharedPrefixLayout`, built on the CPU):

- prompts: the ``G`` distinct prompts, left-padded ``[G, P]``, position ids counting real
  tokens; each attends causally to its own real tokens.
- responses: the ``N`` real response tokens of all rows, flat ``[N]`` (row by row, the rows
  by decreasing length), so the linear layers see no padding; for attention the rows go
  in buckets of at most :data:`BUCKET_ROWS` rows of similar length, each bucket's tokens
  scattered into an ``[R, T]`` grid (``T`` its longest response) whose row ``i`` attends
  to its prompt's keys ``[P]`` (real ones only) and causally to its own ``[T]``. Positions
  continue the prompt's: ``len(prompt) + t``.
- outputs: response token ``t`` of row ``i`` is predicted by the prompt's last state for
  ``t = 0`` and by response state ``t - 1`` otherwise; only those ``N`` states go through
  the output layer, in the batch's flat order (row by row, rows in order).

Attention is PyTorch's ``scaled_dot_product_attention`` with a boolean mask; the layers are
the model's own modules (:mod:`anchor_rl.models.llama`), so this needs a Llama-architecture
model and no attention dropout while training (:func:`shared_prefix_unsupported`). On CUDA
the cuDNN attention backend is left out (:data:`SDPA_CUDNN`): it builds an execution plan
for every new shape, and the buckets give new shapes at every step.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from anchor_rl.models.checkpointing import CHECKPOINT_KWARGS, layer_checkpointed
from anchor_rl.models.llama import (
    ModuleLayer,
    body,
    llama_unsupported,
    module_layers,
    rotary_tables,
)
from anchor_rl.models.padding import distinct_rows, left_pad, position_ids, token_cells

if TYPE_CHECKING:
    from anchor_rl.batch import RolloutBatch

BUCKET_ROWS = 16
"""Rows per attention grid of the responses. One grid of all rows is as wide as the longest
response; grids of rows of similar length (the rows sorted by length) waste less of the
attention's arithmetic on padding (``benchmarks/probe_attention.py`` measures both)."""


def shared_prefix_unsupported(model: PreTrainedModel, head: bool = True) -> str | None:
    """Why the shared-prefix layout cannot run ``model`` (``None`` when it can): a causal LM
    (``head``: it needs its ``lm_head``) or a body such as a critic's backbone."""
    reason = llama_unsupported(model)
    if reason is None and head and not isinstance(getattr(model, "lm_head", None), nn.Module):
        reason = "the model has no lm_head"
    dropout = reason is None and model.training
    if dropout and any(getattr(x.self_attn, "attention_dropout", 0.0) for x in body(model).layers):
        reason = "its attention dropout is on (the layout has no attention dropout)"
    return reason


def has_shared_prompt(prompts: list[list[int]]) -> bool:
    """Whether two of the rows have the same prompt (the layout saves compute only then)."""
    return len({tuple(p) for p in prompts}) < len(prompts)


@dataclass
class Bucket:
    """Rows whose responses attend together, in one ``[R, T]`` grid (``T`` their longest).

    start, stop: their tokens' slice of the layout's ``tokens``. rows: ``[R]`` the batch rows
    and prompt_of ``[R]`` their prompts. cells: ``[stop - start]`` each token's cell
    ``r * T + t`` in the grid. width: ``T``.
    """

    start: int
    stop: int
    rows: torch.Tensor
    prompt_of: torch.Tensor
    cells: torch.Tensor
    width: int

    def to(self, device: torch.device | str) -> Bucket:
        """The same bucket with its tensors on ``device``."""
        return replace(
            self,
            rows=self.rows.to(device),
            prompt_of=self.prompt_of.to(device),
            cells=self.cells.to(device),
        )


@dataclass
class SharedPrefixLayout:
    """Index tensors of one batch in the shared-prefix layout (module docstring).

    prompt_ids, prompt_mask, prompt_pos: ``[G, P]`` left-padded distinct prompts (long;
    mask 1 on real tokens). prompt_of: ``[B]`` each row's prompt. tokens, token_pos:
    ``[N]`` the real response tokens and their position ids, in bucket order (the rows by
    decreasing length, row by row). buckets: the rows in groups of at most
    :data:`BUCKET_ROWS`, each with its own attention grid. row_of, t_of: ``[N]`` the row and
    column of each token in flat order (the batch's rows in order, row by row: the order
    of the outputs). predictor: ``[N]`` the state predicting each token (flat order) in
    ``cat(prompt_last[G], response_states[N])``, the response states in bucket order.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    prompt_pos: torch.Tensor
    prompt_of: torch.Tensor
    tokens: torch.Tensor
    token_pos: torch.Tensor
    row_of: torch.Tensor
    t_of: torch.Tensor
    buckets: list[Bucket]
    predictor: torch.Tensor

    @staticmethod
    def of(batch: RolloutBatch) -> SharedPrefixLayout:
        """The layout of ``batch`` (its responses' real tokens: ``attention_mask`` 1, a
        prefix of each row)."""
        first, copy_of = distinct_rows([tuple(p) for p in batch.prompt_ids])
        prompt_of = torch.as_tensor(copy_of, dtype=torch.long)
        prompt_ids, prompt_mask = left_pad([list(batch.prompt_ids[i]) for i in first], batch.pad_id)
        lengths = batch.attention_mask.sum(-1).long().tolist()
        row_of, t_of = token_cells(lengths)
        # bucket order: the rows by decreasing length (ties in batch order), so that each
        # bucket's grid is about as wide as its rows are long; empty rows have no tokens
        order = sorted((i for i in range(len(lengths)) if lengths[i]), key=lambda i: -lengths[i])
        start = [0] * len(lengths)  # each row's first token in bucket order
        buckets, done = [], 0
        for k in range(0, len(order), BUCKET_ROWS):
            rows = order[k : k + BUCKET_ROWS]
            width, begin = lengths[rows[0]], done
            cells = []
            for r, row in enumerate(rows):
                start[row] = done
                cells += range(r * width, r * width + lengths[row])
                done += lengths[row]
            rows_t = torch.as_tensor(rows, dtype=torch.long)
            buckets.append(
                Bucket(begin, done, rows_t, prompt_of[rows_t], torch.as_tensor(cells), width)
            )
        moved = torch.as_tensor(start, dtype=torch.long)[row_of] + t_of  # flat -> bucket order
        internal_row = torch.empty_like(row_of).index_copy_(0, moved, row_of)
        internal_t = torch.empty_like(t_of).index_copy_(0, moved, t_of)
        prompt_len = prompt_mask.sum(-1)
        # the first token of a row is predicted by its prompt's last state (index g), token
        # t > 0 by the response state just before it (index G + its bucket-order index - 1)
        predictor = torch.where(t_of == 0, prompt_of[row_of], len(first) + moved - 1)
        return SharedPrefixLayout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            prompt_pos=position_ids(prompt_mask),
            prompt_of=prompt_of,
            tokens=batch.response_ids[internal_row, internal_t],
            token_pos=prompt_len[prompt_of[internal_row]] + internal_t,
            row_of=row_of,
            t_of=t_of,
            buckets=buckets,
            predictor=predictor,
        )

    def to(self, device: torch.device | str) -> SharedPrefixLayout:
        """The same layout with every tensor on ``device``."""
        moved = {
            name: value.to(device) if isinstance(value, torch.Tensor) else value
            for name, value in vars(self).items()
        }
        moved["buckets"] = [b.to(device) for b in self.buckets]
        return SharedPrefixLayout(**moved)


SDPA_CUDNN = os.environ.get("ANCHOR_RL_SDPA_CUDNN", "off").lower() in ("1", "on")
"""Whether this module's attention may use cuDNN's backend on CUDA (off unless the
environment sets ``ANCHOR_RL_SDPA_CUDNN=on``). PyTorch may pick cuDNN for bfloat16 on
Hopper GPUs, and cuDNN builds an execution plan for each new shape, while the buckets'
shapes change from step to step (docs/results.md)."""
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: str) -> AbstractContextManager:
    """The SDPA backends this module's attention may use on ``device`` (a device type):
    on CUDA all but cuDNN's unless :data:`SDPA_CUDNN`; elsewhere PyTorch's choice."""
    if device == "cuda" and not SDPA_CUDNN:
        return sdpa_kernel(_CUDA_BACKENDS)
    return nullcontext()


def expand_kv_heads(device: str) -> bool:
    """Whether grouped-query attention on ``device`` (a device type) repeats the key and value
    heads before the masked attention instead of passing ``enable_gqa``: on CUDA, whose fused
    SDPA kernels take a mask or shared key/value heads but not both (with both PyTorch falls
    back to its unfused math kernel, as transformers' own SDPA path avoids by the same
    repetition); elsewhere not."""
    return device == "cuda"


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of ``q[R, heads, Q, D]`` over ``k``, ``v`` ``[R, kv_heads, K, D]`` where
    ``allowed[R, 1, Q, K]``; the heads' outputs ``[R, Q, heads * D]``, in ``v``'s dtype.

    On the CPU, attention in bfloat16 (under ``optim.autocast = "bf16"``, or a bfloat16
    model) runs in float32 instead: the CPU kernel's bfloat16 backward is slower than its
    float32 one (``benchmarks/probe_attention.py``), and a float32 softmax is the more exact.
    """
    device, dtype = q.device.type, v.dtype
    upcast = device == "cpu" and (torch.is_autocast_enabled(device) or dtype != torch.float32)
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    grouped = q.shape[1] != k.shape[1]
    if grouped and expand_kv_heads(device):
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        grouped = False
    with torch.autocast(device, enabled=False) if upcast else nullcontext(), sdpa_backends(device):
        out = scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=grouped
        )
    return out.to(dtype).transpose(1, 2).flatten(2)


ROW_MULTIPLE = 128
"""On the CPU in bfloat16 the token-wide products run on ``N`` rows padded up to a multiple
of this (:func:`padded_rows`)."""


def padded_rows(n: int, like: torch.Tensor) -> int:
    """Rows to add to a token-wide pass of ``n`` rows (``like``: a tensor on its device,
    of its dtype) so that its matrix products take one of a few shapes: on the CPU in
    bfloat16 (autocast or bfloat16 weights) up to a multiple of :data:`ROW_MULTIPLE`, else 0.

    PyTorch runs CPU bfloat16 products on oneDNN, which builds (JIT-compiles) a primitive
    for every new shape and caches it; the token count changes every step, so every
    token-wide product of every step paid for a new one, more than the padding's arithmetic
    costs (docs/results.md). float32
    products go to MKL, which has no such cost: no padding."""
    device = like.device.type
    half = torch.is_autocast_enabled(device) or like.dtype in (torch.bfloat16, torch.float16)
    if device != "cpu" or not half or ROW_MULTIPLE <= 1:
        return 0
    return -n % ROW_MULTIPLE


def shared_prefix_logits(model: PreTrainedModel, layout: SharedPrefixLayout) -> torch.Tensor:
    """Logits ``[N, V]`` of the ``N`` response tokens of ``layout`` (on the model's device),
    in its flat token order; gradients flow when grad is enabled."""
    states = shared_prefix_states(model.model, layout)
    n = len(states)
    extra = padded_rows(n, model.lm_head.weight)
    if extra:  # zero rows: logits 0, sliced off (their gradient is 0)
        states = torch.cat([states, states.new_zeros(extra, states.shape[-1])])
    return model.lm_head(states)[:n]


def shared_prefix_states(inner: nn.Module, layout: SharedPrefixLayout) -> torch.Tensor:
    """The final (normed) hidden states ``[N, H]`` of the decoder stack ``inner`` that
    predict the ``N`` response tokens of ``layout``: state ``i`` has seen the prompt and the
    response tokens before token ``i``, as the last hidden state of the model's own forward
    at that position. Flat token order; gradients flow when grad is enabled."""
    device = layout.tokens.device
    p = layout.prompt_ids.shape[1]
    if not layout.buckets:  # no response tokens: nothing to predict
        return inner.norm(inner.embed_tokens(layout.tokens))
    # the prompts' mask: causal over real keys; a padding query sees itself (no empty row)
    real = layout.prompt_mask.bool()
    causal = torch.ones(p, p, dtype=torch.bool, device=device).tril()
    itself = torch.eye(p, dtype=torch.bool, device=device)
    prompt_allowed = ((causal[None] & real[:, None, :]) | itself)[:, None]  # [G, 1, P, P]
    # each bucket's mask: its rows' prompt keys (real ones), then causal over their own cells
    response_allowed = []
    for bucket in layout.buckets:
        r, t = len(bucket.rows), bucket.width
        own = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(r, t, t)
        prompt_keys = real[bucket.prompt_of][:, None, :].expand(r, t, p)
        response_allowed.append(torch.cat([prompt_keys, own], -1)[:, None])  # [R, 1, T, P + T]

    prompts = inner.embed_tokens(layout.prompt_ids)  # [G, P, H]
    # rows of padding after the N tokens (CPU bfloat16: stable product shapes); they attend
    # to nothing and nothing reads them
    extra = padded_rows(len(layout.tokens), inner.embed_tokens.weight)
    ids, pos = layout.tokens, layout.token_pos
    if extra:
        ids, pos = (torch.cat([x, x.new_zeros(extra)]) for x in (ids, pos))
    tokens = inner.embed_tokens(ids)  # [N + extra, H]
    cos_p, sin_p = rotary_tables(inner, prompts, layout.prompt_pos)  # [G, P, D]
    cos_r, sin_r = rotary_tables(inner, tokens[None], pos[None])  # [1, N + extra, D]
    cos_p, sin_p = cos_p[:, :, None], sin_p[:, :, None]  # [G, P, 1, D]: every head
    cos_r, sin_r = cos_r[0, :, None], sin_r[0, :, None]  # [N, 1, D]
    scale = inner.layers[0].self_attn.scaling if len(inner.layers) else 1.0

    # each bucket's tokens, then the padding rows: one split (its backward one concatenation,
    # where slicing each bucket off would zero-fill a whole [N, heads, D] gradient per bucket)
    sizes = [bucket.stop - bucket.start for bucket in layout.buckets]
    sizes.append(len(tokens) - sum(sizes))

    def grid(part: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """The bucket's tokens ``part[stop - start, heads, D]`` in its attention grid
        ``[R, heads, T, D]``."""
        r, t = len(bucket.rows), bucket.width
        cells = part.new_zeros(r * t, *part.shape[1:]).index_copy(0, bucket.cells, part)
        return cells.view(r, t, *part.shape[1:]).transpose(1, 2)

    def run_layer(
        layer: ModuleLayer, prompts: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer on the prompts' ``[G, P, H]`` and the tokens' ``[N + extra, H]``
        states."""
        qp, kp, vp = (x.transpose(1, 2) for x in layer.project(prompts, cos_p, sin_p))
        qr, kr, vr = (x.split(sizes) for x in layer.project(tokens, cos_r, sin_r))
        prompt_out = _attend(qp, kp, vp, prompt_allowed, scale)  # [G, P, heads * D]
        response_out = []
        for i, (bucket, allowed) in enumerate(zip(layout.buckets, response_allowed, strict=True)):
            keys = torch.cat([kp[bucket.prompt_of], grid(kr[i], bucket)], 2)  # [R, kv, P + T, D]
            values = torch.cat([vp[bucket.prompt_of], grid(vr[i], bucket)], 2)
            out = _attend(grid(qr[i], bucket), keys, values, allowed, scale)  # [R, T, heads * D]
            response_out.append(out.reshape(-1, out.shape[-1]).index_select(0, bucket.cells))
        if extra:
            response_out.append(response_out[-1].new_zeros(extra, response_out[-1].shape[-1]))
        return layer.finish(prompts, prompt_out), layer.finish(tokens, torch.cat(response_out))

    # activation checkpointing (optim.activation_checkpointing): each layer keeps its inputs
    # only and is run again in the backward pass, as the model's own forward does
    recompute = torch.is_grad_enabled() and inner.training
    for layer in module_layers(inner, len(tokens)):  # packed weights when no grad is taken
        if recompute and layer_checkpointed(layer.layer):
            prompts, tokens = checkpoint(run_layer, layer, prompts, tokens, **CHECKPOINT_KWARGS)
        else:
            prompts, tokens = run_layer(layer, prompts, tokens)
    states = torch.cat([prompts[:, -1], tokens])[layout.predictor]  # [N, H]
    return inner.norm(states)
