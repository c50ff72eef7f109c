"""Log-probs and entropies of response tokens under a causal LM.

Three layouts compute the same function (up to float rounding, pinned in the tests):

- padded: the prompt is left-padded and the response right-padded, then the two are
  concatenated: ``[pad.. prompt | response ..pad]``, so every response starts at the same
  column and the logits that predict it are the last ``T + 1`` positions but one. Position
  ids count real tokens only, so a row's positions do not depend on how much padding it
  got. Every row costs the pass's longest prompt plus its longest response (a micro-batch is
  cut to its own, :meth:`RolloutBatch.trimmed`).
- packed (padding-free): each row's real tokens, ``prompt + response``, are laid end to end
  in a few bins (first-fit decreasing into bins twice the longest row), position ids
  restarting at 0 for every row and no attention mask, so the model's mask builder makes
  the attention block-diagonal (Hugging Face's packed-sequence format, as TRL's
  ``padding_free``). Only real tokens are computed, and the output layer runs only on the
  states that predict response tokens. Used for Llama-architecture models
  (:func:`packing_supported`), whose masks honour the format.
- shared prefix: as packed, but each distinct prompt runs through the model once for all
  the rows that share it (:mod:`anchor_rl.models.shared_prefix`); a GRPO group of n
  responses pays for its prompt once instead of n times. Used where a prompt repeats and
  the model's layers are plain Llama layers.

Which layout a pass takes by default depends on the device. On the CPU the arithmetic
decides: shared prefixes where a prompt repeats, else packed. On a GPU a pass of a few
thousand tokens waits on kernel launches, and the padded layout's few large kernels beat
packing's gathers and block-diagonal attention and the shared-prefix layout's per-bucket
attention, and packing pays only in passes of many tokens with much padding
(:func:`gpu_packs`; measured in docs/results.md, "The update's layouts on a GPU").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel

from anchor_rl.models.padding import left_pad, position_ids, token_cells
from anchor_rl.models.shared_prefix import (
    SharedPrefixLayout,
    has_shared_prompt,
    shared_prefix_logits,
    shared_prefix_unsupported,
)

if TYPE_CHECKING:
    from anchor_rl.batch import RolloutBatch


def entropy_from_logp(logp: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum p log p`` over the last axis of normalised log-probs ``[..., V]``.

    Works from ``log_softmax`` output, so large logits never overflow; ``-inf`` entries
    (masked tokens) contribute 0, in value and in gradient.
    """
    finite = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp.exp() * finite).sum(-1)


def pack_prompt_response(
    batch: RolloutBatch, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids[B, L], mask[B, L], positions[B, L])`` of ``[pad.. prompt | response ..pad]`` on
    ``device`` (long tensors; L = longest prompt + T).

    The last ``T + 1`` columns but one end the states that predict the ``T`` response
    tokens: column ``L - T - 1 + t`` ends ``prompt + response[:t]``.
    """
    prompt_ids, prompt_mask = left_pad(batch.prompt_ids, batch.pad_id)
    ids = torch.cat([prompt_ids.to(device), batch.response_ids.to(device)], dim=1)
    mask = torch.cat([prompt_mask.to(device), batch.attention_mask.to(device).long()], dim=1)
    return ids, mask, position_ids(mask)


_PACKABLE = ("llama", "mistral", "qwen2")


def packing_supported(model: PreTrainedModel, head: bool = True) -> bool:
    """Whether the packed layout is exact for ``model``: a Llama-architecture model (its mask
    builder reads restarting position ids as separate sequences) with no sliding window and,
    for a causal LM (``head``), ``model.model`` and ``lm_head``; ``head`` False: a body such
    as a critic's backbone."""
    config = model.config
    causal_lm = isinstance(getattr(model, "model", None), PreTrainedModel) and hasattr(
        model, "lm_head"
    )
    return (
        getattr(config, "model_type", None) in _PACKABLE
        and not (
            getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
        )
        and (causal_lm or not head)
    )


def pack_rows(lengths: list[int]) -> tuple[list[int], list[int], int]:
    """First-fit-decreasing bins for rows of ``lengths`` tokens: ``(bin, offset)`` of each
    row and the bin width (twice the longest row)."""
    width = 2 * max(lengths)
    room: list[int] = []
    where, offset = [0] * len(lengths), [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((b for b, free in enumerate(room) if free >= lengths[i]), len(room))
        if b == len(room):
            room.append(width)
        where[i], offset[i] = b, width - room[b]
        room[b] -= lengths[i]
    return where, offset, width


GPU_PACK_MIN_FLOP = 5e11
"""On a GPU, ``packed=None`` packs a pass only if its forward is at least this much work,
``2 x parameters x real tokens`` FLOP: below it a pass waits on kernel launches
(the thresholds' measurements: docs/results.md, "The update's layouts on a GPU")."""
GPU_PACK_MIN_SAVING = 1.2
"""... and only if its padded layout computes at least this many times the packed layout's
token cells."""


def pass_cells(batch: RolloutBatch) -> dict[str, int]:
    """The token cells one pass over ``batch`` runs through the model: ``real`` (prompt and
    response tokens), ``padded`` (``B x (longest prompt + longest response)``, the padded
    layout cutting the columns past the longest response) and ``packed`` (its bins,
    :func:`pack_rows`)."""
    lengths = [
        len(p) + n
        for p, n in zip(batch.prompt_ids, batch.attention_mask.sum(-1).long().tolist(), strict=True)
    ]
    where, _, width = pack_rows(lengths)
    return {
        "real": sum(lengths),
        "padded": len(batch) * (max(map(len, batch.prompt_ids)) + batch.response_width),
        "packed": (max(where) + 1) * width,
    }


def gpu_packs(batch: RolloutBatch, parameters: int) -> bool:
    """Whether a GPU pass over ``batch`` with a model of ``parameters`` packs by default
    (``packed=None``) rather than pads: its forward is :data:`GPU_PACK_MIN_FLOP` or more and
    padding would cost :data:`GPU_PACK_MIN_SAVING` times the packed cells or more
    (:func:`pass_cells`)."""
    cells = pass_cells(batch)
    return (
        2 * parameters * cells["real"] >= GPU_PACK_MIN_FLOP
        and cells["padded"] >= GPU_PACK_MIN_SAVING * cells["packed"]
    )


def shares_by_default(device: torch.device) -> bool:
    """Whether ``shared=None`` (``optim.shared_prefix=auto``) shares prompts on ``device``:
    on the CPU, not on a GPU (module docstring)."""
    return device.type != "cuda"


def pass_layout(
    batch: RolloutBatch,
    packed: bool | None,
    shared: bool | None,
    can_pack: bool,
    can_share: bool,
    device: torch.device,
    parameters: int,
) -> str:
    """The layout of one scoring pass over ``batch``: ``"padded"``, ``"packed"`` or
    ``"shared"``. ``packed`` and ``shared`` as :func:`token_logprobs` takes them (already
    checked against the model), ``can_pack`` / ``can_share`` whether the model allows each,
    ``device`` where it runs and ``parameters`` the model's size: the defaults follow
    :func:`shares_by_default` and, on a GPU, :func:`gpu_packs`."""
    if shared:
        return "shared"
    if packed is False or not can_pack:
        return "padded"
    default_share = shared is None and can_share and shares_by_default(device)
    if default_share and has_shared_prompt(batch.prompt_ids):
        return "shared"
    if packed is None and device.type == "cuda" and not gpu_packs(batch, parameters):
        return "padded"
    return "packed"


class ScoringForward(torch.nn.Module):
    """One scoring pass of a causal LM as one call of this module, in any layout.

    A wrapper that hooks a module's ``forward`` -- ``DistributedDataParallel``, whose hooks
    prepare the gradient all-reduce -- must see every pass, and the packed and shared-prefix
    layouts call the model's parts separately; this module makes each pass one call.
    ``forward(ids, positions, mask=None, keep=0, select=None, shared=None)``: padded
    (``select`` and ``shared`` None), the model's logits ``[B, keep, V]`` of the last
    ``keep`` columns; packed, the logits ``[N, V]`` of the states at ``select = (bins[N],
    cols[N])``; shared prefix (``ids`` and ``positions`` unused), the logits ``[N, V]`` of
    the layout's response tokens.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.lm = model

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        keep: int = 0,
        select: tuple[torch.Tensor, torch.Tensor] | None = None,
        shared: SharedPrefixLayout | None = None,
    ) -> torch.Tensor:
        if shared is not None:
            return shared_prefix_logits(self.lm, shared)
        if select is None:
            return self.lm(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=keep,
            ).logits
        hidden = self.lm.model(input_ids=ids, position_ids=positions, use_cache=False)
        return self.lm.lm_head(hidden.last_hidden_state[select])


Flat = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(logits[N, V], row_of[N], t_of[N])``: the logits of a batch's N real response tokens
and each token's row and column (row by row, CPU index tensors)."""


def packed_inputs(
    batch: RolloutBatch, device: torch.device
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor], Tensor, Tensor]:
    """The packed layout of ``batch`` (module docstring): ``(ids[bins, W], positions[bins, W],
    select, row_of[N], t_of[N])``: the bins' token ids and restarting position ids (on
    ``device``), ``select = (bins[N], cols[N])`` the cells (on ``device``) whose states
    predict the N real response tokens, and each token's row and column (CPU, row by row)."""
    response_len = batch.attention_mask.sum(-1).long().tolist()
    responses = batch.response_ids.tolist()
    rows = [[*p, *r[:n]] for p, r, n in zip(batch.prompt_ids, responses, response_len, strict=True)]
    where, offset, width = pack_rows([len(r) for r in rows])
    ids = torch.full((max(where) + 1, width), batch.pad_id, dtype=torch.long)
    pos = torch.zeros_like(ids)
    for row, b, o in zip(rows, where, offset, strict=True):
        ids[b, o : o + len(row)] = torch.as_tensor(row, dtype=torch.long)
        pos[b, o : o + len(row)] = torch.arange(len(row))
    # response token t of row i is predicted by the state at column o_i + len(prompt_i) - 1 + t
    row_of, t_of = token_cells(response_len)
    starts = torch.as_tensor(
        [o + len(p) - 1 for o, p in zip(offset, batch.prompt_ids, strict=True)]
    )
    bins, cols = torch.as_tensor(where)[row_of], starts[row_of] + t_of
    return ids.to(device), pos.to(device), (bins.to(device), cols.to(device)), row_of, t_of


def _packed_logits(device: torch.device, forward: torch.nn.Module, batch: RolloutBatch) -> Flat:
    """The response tokens' logits in the packed layout (see the module docstring)."""
    ids, positions, select, row_of, t_of = packed_inputs(batch, device)
    return forward(ids, positions, select=select), row_of, t_of


def _shared_logits(device: torch.device, forward: torch.nn.Module, batch: RolloutBatch) -> Flat:
    """The response tokens' logits in the shared-prefix layout
    (:mod:`anchor_rl.models.shared_prefix`)."""
    layout = SharedPrefixLayout.of(batch)
    unused = torch.zeros(0, dtype=torch.long)
    return forward(unused, unused, shared=layout.to(device)), layout.row_of, layout.t_of


def _token_outputs(
    flat: Flat, batch: RolloutBatch, with_entropy: bool, temperature: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logp[B, T], entropy[B, T] | None)`` from the logits of the response tokens (0 at
    the columns past each response)."""
    logits, row_of, t_of = flat
    device = logits.device
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    tokens = batch.response_ids[row_of, t_of].to(device)
    shape, where_rt = batch.response_ids.shape, (row_of.to(device), t_of.to(device))
    zeros = torch.zeros(shape, device=device)
    logp = zeros.index_put(where_rt, logp_all.gather(-1, tokens[:, None]).squeeze(-1))
    entropy = zeros.index_put(where_rt, entropy_from_logp(logp_all)) if with_entropy else None
    return logp, entropy


def _score(
    model: PreTrainedModel,
    forward: torch.nn.Module,
    batch: RolloutBatch,
    with_entropy: bool,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    device, width = model.device, batch.response_ids.shape[1]
    batch = batch.trimmed()  # no columns past the longest response (a micro-batch's T)
    ids, mask, positions = pack_prompt_response(batch, device)
    response_mask = batch.attention_mask.to(device)
    t = batch.response_ids.shape[1]
    logits = forward(ids, positions, mask=mask, keep=t + 1)[:, :-1, :]
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, batch.response_ids.to(device)[..., None]).squeeze(-1) * response_mask
    entropy = entropy_from_logp(logp_all) * response_mask if with_entropy else None
    if t < width:  # back to the batch's width, 0 past the responses
        logp = F.pad(logp, (0, width - t))
        entropy = None if entropy is None else F.pad(entropy, (0, width - t))
    return logp, entropy


def token_logprobs(
    model: PreTrainedModel,
    batch: RolloutBatch,
    with_entropy: bool = False,
    micro_batch: int | None = None,
    temperature: float = 1.0,
    packed: bool | None = None,
    forward: torch.nn.Module | None = None,
    shared: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``batch.response_ids`` given the prompts: ``(logp[B, T], entropy[B, T] | None)``.

    Both are 0 where ``batch.attention_mask`` is 0 and live on the model's device.
    Gradients flow when called with grad enabled. ``micro_batch`` bounds the rows per
    forward pass (the ``[rows, T, V]`` logits are the memory peak). ``temperature``
    divides the logits first (1.0: the model's own distribution). ``forward``: the module
    each pass calls, a wrapper of ``ScoringForward(model)`` such as
    ``DistributedDataParallel`` (default: ``ScoringForward(model)`` itself).

    The layout of each pass (:func:`pass_layout`; module docstring): ``packed`` False
    scores padded. Otherwise ``shared`` True scores each pass with shared prefixes
    (ValueError if the model cannot be); None does on the CPU where a prompt repeats
    within the pass and :func:`shared_prefix_unsupported` has no objection; and the rest
    packs: ``packed`` True always (ValueError if the model cannot be), None where
    :func:`packing_supported` and, on a GPU, where :func:`gpu_packs` (else padded).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if micro_batch is not None and micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    if shared and packed is False:
        raise ValueError("shared-prefix scoring is padding-free: it cannot run with packed=False")
    b = len(batch)
    step = micro_batch or b
    chunks = (
        [batch]
        if step >= b
        else [batch.select(range(i, min(i + step, b))) for i in range(0, b, step)]
    )
    unshareable = None if shared is False else shared_prefix_unsupported(model)
    if shared and unshareable:
        raise ValueError(f"shared-prefix scoring cannot run {type(model).__name__}: {unshareable}")
    can_pack = packing_supported(model)
    if packed and not can_pack:
        raise ValueError(
            f"packed scoring needs a Llama-architecture model, not {type(model).__name__}"
        )
    forward = ScoringForward(model) if forward is None else forward
    parameters = sum(p.numel() for p in model.parameters())
    parts = []
    for chunk in chunks:
        kind = pass_layout(
            chunk, packed, shared, can_pack, unshareable is None, model.device, parameters
        )
        if kind == "padded":
            parts.append(_score(model, forward, chunk, with_entropy, temperature))
            continue
        flat = (_shared_logits if kind == "shared" else _packed_logits)(
            model.device, forward, chunk
        )
        parts.append(_token_outputs(flat, chunk, with_entropy, temperature))
    logp = torch.cat([p[0] for p in parts])
    entropy = torch.cat([p[1] for p in parts]) if with_entropy else None
    return logp, entropy
