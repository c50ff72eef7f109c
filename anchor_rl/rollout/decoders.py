"""The forward passes behind one generation turn: Hugging Face's, and a static-cache one.

:func:`~anchor_rl.rollout.sampling.generate_turn` drives a :class:`Decoder`: ``prefill`` the
left-padded contexts, then one ``step`` per generated token, dropping finished rows with
``select``. Two implementations:

- :class:`HFDecoder` calls the model's own ``forward`` with its ``DynamicCache``; it works
  for every causal LM. Each decoding step pays for the library's generality: the causal
  mask is rebuilt, every layer's cache grows by ``torch.cat`` (a copy of the whole cache,
  so a turn's copying is quadratic in its length), and output objects are built.
- :class:`StaticDecoder` runs the decoder layers of a Llama-architecture model (Llama,
  Mistral without a sliding window, Qwen2 without one) itself, on the model's own
  modules and weights, with the keys and values written in place into buffers allocated
  once per turn for the whole budget, and a boolean padding mask sliced to the current
  column. Finished rows stay in the batch until fewer than three quarters of the rows
  are live, then the buffers are compacted, so a turn copies its cache O(log B) times
  instead of once per finished row.

Both compute the same function; they differ in floating-point rounding only (the
reduction order of the attention over a longer, masked key axis), pinned in the tests to
1e-5 on the logits. ``decoder_for`` picks the static one where the model is supported.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
from transformers import PreTrainedModel

DecodeMode = Literal["auto", "static", "hf"]
DECODE_MODES: tuple[str, ...] = ("auto", "static", "hf")


class Decoder(Protocol):
    """Logits for the next token of each live row; rows are positions in the live batch."""

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, budget: int
    ) -> torch.Tensor:
        """Run the contexts ``ids[B, L]`` (left-padded; ``mask[B, L]`` 1 on real tokens,
        ``pos[B, L]`` their position ids) ahead of at most ``budget`` steps; the logits
        ``[B, V]`` at the last column."""
        ...

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Append ``tokens[B]`` at positions ``pos[B]``; the logits ``[B, V]`` after them."""
        ...

    def select(self, index: torch.Tensor) -> None:
        """Keep only the live rows ``index[B']`` (in that order) for the following steps."""
        ...


class HFDecoder:
    """The model's own forward with a ``DynamicCache`` (any causal LM)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache = None
        self.mask: torch.Tensor | None = None

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, budget: int
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1
        )
        self.cache, self.mask = out.past_key_values, mask
        return out.logits[:, -1, :]

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(tokens), 1))], dim=-1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=pos[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        return out.logits[:, -1, :]

    def select(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]


_LLAMA_LIKE = ("llama", "mistral", "qwen2")


def static_unsupported(model: PreTrainedModel) -> str | None:
    """Why :class:`StaticDecoder` cannot run ``model`` (``None`` when it can)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in _LLAMA_LIKE:
        return f"model_type {kind!r} is not one of {', '.join(_LLAMA_LIKE)}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "the model uses sliding-window attention"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model.model, "rotary_emb"):
        return "the model has no model.layers / model.rotary_emb"
    attn = layers[0].self_attn
    if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "its attention has no q/k/v/o projections"
    if (
        any(hasattr(attn, extra) for extra in ("q_norm", "k_norm", "sinks", "rotary_fn"))
        or getattr(config, "pretraining_tp", 1) != 1
    ):
        return "its attention is not plain Llama attention"
    return None


def decoder_for(model: PreTrainedModel, mode: DecodeMode = "auto") -> Decoder:
    """The decoder ``mode`` names: ``static`` (ValueError naming why, if the model is not
    supported), ``hf``, or ``auto`` (static where supported, else hf)."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")
    if mode == "hf":
        return HFDecoder(model)
    reason = static_unsupported(model)
    if reason is None:
        return StaticDecoder(model)
    if mode == "static":
        raise ValueError(f"decode=static cannot run {type(model).__name__}: {reason}")
    return HFDecoder(model)


def _bias(attend: torch.Tensor) -> torch.Tensor:
    """The additive attention mask of a boolean one: 0 where ``attend``, -inf elsewhere."""
    zeros = torch.zeros(attend.shape, device=attend.device)
    return zeros.masked_fill_(~attend, float("-inf"))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x[B, H, T, D]`` with ``cos``/``sin`` ``[B, 1, T, D]`` (half-split
    rotation, as Llama's ``apply_rotary_pos_emb``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class StaticDecoder:
    """A Llama-architecture model's decoder layers run with preallocated key/value buffers.

    Buffers are ``[B, H_kv, L + budget, D]`` per layer for keys and values, allocated at
    ``prefill``; a step past the budget is an error.
    """

    COMPACT_BELOW = 0.75
    """Compact the buffers once fewer than this share of their rows is live."""

    def __init__(self, model: PreTrainedModel):
        reason = static_unsupported(model)
        if reason is not None:
            raise ValueError(f"StaticDecoder cannot run {type(model).__name__}: {reason}")
        self.model = model
        self.inner = model.model
        attn = self.inner.layers[0].self_attn
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.keep = torch.zeros(0, 0, dtype=torch.bool)
        self.rows = torch.zeros(0, dtype=torch.long)  # buffer row of each live row
        self.column = 0  # next column to write

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, budget: int
    ) -> torch.Tensor:
        b, length = ids.shape
        width = length + budget
        device = ids.device
        dtype = self.inner.embed_tokens.weight.dtype
        shape = (b, self.kv_heads, width, self.head_dim)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in self.inner.layers]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in self.inner.layers]
        self.keep = torch.zeros((b, width), dtype=torch.bool, device=device)
        self.keep[:, :length] = mask.bool()
        self.rows = torch.arange(b, device=device)
        # causal and padding mask; a padding query attends to itself so no row is empty
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        attend = causal[None] & self.keep[:, None, :length]
        attend |= torch.eye(length, dtype=torch.bool, device=device)[None]
        hidden = self._layers(self.inner.embed_tokens(ids), pos, _bias(attend[:, None]), 0, length)
        self.column = length
        return self._logits(hidden[:, -1:, :])

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if len(tokens) != len(self.rows):
            raise ValueError(f"{len(tokens)} tokens for {len(self.rows)} live rows")
        column = self.column
        if column >= self.keep.shape[1]:
            raise RuntimeError(
                f"the static cache is full ({column} columns): a step past the budget"
            )
        if len(self.rows) < self.keep.shape[0]:  # finished rows still in the buffers
            full = torch.zeros(self.keep.shape[0], dtype=tokens.dtype, device=tokens.device)
            tokens = full.index_copy(0, self.rows, tokens)
            pos = torch.zeros_like(full).index_copy(0, self.rows, pos)
        self.keep[:, column] = True
        bias = _bias(self.keep[:, None, None, : column + 1])
        hidden = self._layers(
            self.inner.embed_tokens(tokens[:, None]), pos[:, None], bias, column, 1
        )
        self.column = column + 1
        logits = self._logits(hidden)
        return logits if len(self.rows) == len(logits) else logits[self.rows]

    def select(self, index: torch.Tensor) -> None:
        self.rows = self.rows[index.to(self.rows.device)]
        if len(self.rows) >= self.COMPACT_BELOW * self.keep.shape[0]:
            return
        self.keys = [k[self.rows] for k in self.keys]
        self.values = [v[self.rows] for v in self.values]
        self.keep = self.keep[self.rows]
        self.rows = torch.arange(len(self.rows), device=self.rows.device)

    def _layers(
        self, hidden: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor, start: int, n: int
    ) -> torch.Tensor:
        """Run every decoder layer on ``hidden[B, n, H]`` at positions ``pos[B, n]``,
        writing keys and values to columns ``start .. start + n``; ``bias[B, 1, n, K]``
        (0 or -inf) says which of the first ``K = start + n`` columns each query sees."""
        b = hidden.shape[0]
        cos, sin = self.inner.rotary_emb(hidden, pos)
        cos, sin = cos[:, None], sin[:, None]
        end = start + n
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads  # query heads per key/value head
        for layer, keys, values in zip(self.inner.layers, self.keys, self.values, strict=True):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = _rotate(attn.q_proj(x).view(b, n, heads, d).transpose(1, 2), cos, sin)
            k = attn.k_proj(x).view(b, n, kv_heads, d).transpose(1, 2)
            keys[:, :, start:end] = _rotate(k, cos, sin)
            values[:, :, start:end] = attn.v_proj(x).view(b, n, kv_heads, d).transpose(1, 2)
            # batched matmuls on strided views of the buffers (no copy of the cache):
            # [B * H_kv, group * n, D] @ [B * H_kv, D, K] -> scores [B, H, n, K]
            width = keys.shape[2]
            k_seen = keys.view(b * kv_heads, width, d)[:, :end]
            v_seen = values.view(b * kv_heads, width, d)[:, :end]
            scores = torch.bmm(q.reshape(b * kv_heads, group * n, d), k_seen.transpose(1, 2))
            scores = scores.view(b, heads, n, end).mul_(self.scaling).add_(bias)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
            probs = probs.view(b * kv_heads, group * n, end)
            out = torch.bmm(probs, v_seen).view(b, heads, n, d)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(b, n, heads * d))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` logits of the last position of ``hidden[B, n, H]``."""
        return self.model.lm_head(self.inner.norm(hidden[:, -1, :]))
