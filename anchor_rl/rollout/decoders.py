"""The forward passes behind one generation turn: Hugging Face's, and a static-cache one.

:func:`~anchor_rl.rollout.sampling.generate_turn` drives a :class:`Decoder`: ``prefill`` the
left-padded contexts, then one ``step`` per generated token, dropping finished rows with
``select``. Two implementations:

- :class:`HFDecoder` calls the model's own ``forward`` with its ``DynamicCache``; it works
  for every causal LM. Each decoding step pays for the library's generality: the causal
  mask is rebuilt, every layer's cache grows by ``torch.cat`` (a copy of the whole cache,
  so a turn's copying is quadratic in its length), and output objects are built.
- :class:`StaticDecoder` runs the decoder layers of a Llama-architecture model (Llama,
  Mistral without a sliding window, Qwen2 without one) itself, on the model's weights
  (on the CPU prepared once per turn, ``anchor_rl.models.llama.FrozenLayer``; elsewhere
  through its modules), with the keys and values written in place into preallocated
  buffers (grown a few columns at a time, so a step's reads stay compact), and a boolean
  padding mask sliced to the current column. Finished rows stay in the batch until fewer
  than three quarters of the rows are live, then the buffers are compacted, so a turn
  copies its cache O(log B) times instead of once per finished row (and once per
  ``GROW_COLUMNS`` steps to grow it). The prefill runs each distinct context once and
  copies its keys and values to the rows that share it (the n samples of a prompt).

Both compute the same function; they differ in floating-point rounding only (the
reduction order of the attention over a longer, masked key axis), pinned in the tests to
1e-5 on the logits. ``decoder_for`` picks the static one where the model is supported.

``decode="graph"`` (CUDA only; what ``auto`` picks for a supported model on CUDA) runs
the static decoder with static shapes and replays each decode step as a CUDA graph: the
buffers get the whole budget's columns at the prefill, a step writes its column with
``index_copy_`` at a column held in a device tensor and attends over its span (the first
128, 256, 512, ... columns, the smallest past it; unwritten ones masked), and finished rows
stay in the buffers (no compaction), so one graph per span, captured at the span's first
step, serves all its steps: a graph launches a step's kernels at once (docs/results.md).
Under ``auto`` a capture that fails is reported as a warning and the model decodes without
graphs from then on; under ``graph`` it is an error.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Literal, Protocol

import torch
from torch.nn.functional import embedding, scaled_dot_product_attention
from transformers import PreTrainedModel

from anchor_rl.models.llama import (
    LayerPass,
    decode_layers,
    llama_unsupported,
    rotary_tables,
    static_rope,
)
from anchor_rl.models.padding import distinct_rows

DecodeMode = Literal["auto", "static", "hf", "graph"]
DECODE_MODES: tuple[str, ...] = ("auto", "static", "hf", "graph")

_CAPTURE_FAILED: weakref.WeakSet = weakref.WeakSet()
"""Models whose decode step failed to capture under ``auto``: they decode eagerly after."""


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
        """Append ``tokens[B]`` at positions ``pos[B]``; the logits ``[B, V]`` after them. A
        row's position is at most its position at the prefill's last column plus the steps
        so far (it is below ``L + budget``), as a sampler's are."""
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
        self.cache_name = cache_argument(model)

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, budget: int
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1
        )
        self.cache, self.mask = getattr(out, self.cache_name), mask
        return out.logits[:, -1, :]

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(tokens), 1))], dim=-1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=pos[:, None],
            use_cache=True,
            **{self.cache_name: self.cache},
        )
        return out.logits[:, -1, :]

    def select(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]


def cache_argument(model: PreTrainedModel) -> str:
    """The name of the key/value cache in ``model``'s forward and output: ``cache`` where
    its transformers has it, else ``past_key_values``."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def static_unsupported(model: PreTrainedModel) -> str | None:
    """Why :class:`StaticDecoder` cannot run ``model`` (``None`` when it can)."""
    if not hasattr(model, "lm_head"):
        return "the model has no lm_head"
    return llama_unsupported(model)


def decoder_for(model: PreTrainedModel, mode: DecodeMode = "auto") -> Decoder:
    """The decoder ``mode`` names: ``static`` or ``graph`` (ValueError naming why, if the
    model is not supported; ``graph`` samples on CUDA only, checked at the prefill), ``hf``,
    or ``auto``: where the model is supported, ``graph`` on a device that replays graphs
    (CUDA; eager again if a capture fails) and ``static`` elsewhere, else ``hf``."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")
    if mode == "hf":
        return HFDecoder(model)
    reason = static_unsupported(model)
    if reason is None:
        if mode == "auto" and _StepGraph.runs_on(model.device) and model not in _CAPTURE_FAILED:
            return StaticDecoder(model, graphs=True, eager_if_capture_fails=True)
        return StaticDecoder(model, graphs=mode == "graph")
    if mode in ("static", "graph"):
        raise ValueError(f"decode={mode} cannot run {type(model).__name__}: {reason}")
    return HFDecoder(model)


def _bias(attend: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask of a boolean one, in ``dtype``: 0 where ``attend``, -inf
    elsewhere."""
    zeros = torch.zeros(attend.shape, device=attend.device, dtype=dtype)
    return zeros.masked_fill_(~attend, float("-inf"))


class StaticDecoder:
    """A Llama-architecture model's decoder layers run with preallocated key/value buffers.

    Attention over the buffers (``attention``; None: ``sdpa`` for a bfloat16 or float16
    model on the CPU, ``matmul`` otherwise, chosen at the prefill):

    - ``sdpa``: PyTorch's ``scaled_dot_product_attention`` on keys and values ``[B, H_kv,
      W, D]`` with a boolean mask, the query heads of each key/value head folded into the
      query axis. On the CPU its fused kernel reads the cache once and keeps the softmax in
      float32, where a bfloat16 batched matmul of a decode step's shapes is slow
      (``docs/results.md``).
    - ``matmul``: two batched matmuls and a float32 softmax between them, keys stored
      transposed (``[B, H_kv, D, W]``, so the scores are a matmul on a plain column slice),
      values ``[B, H_kv, W, D]``; what CUDA runs (and captures in graphs). A step's scores
      are one ``baddbmm`` (scale and mask inside the product); the prefill keeps its mask
      broadcast over the heads (per head it would be a copy as large as the scores).

    ``W`` starts at the context's length ``L`` plus :attr:`GROW_COLUMNS` and grows
    by as many columns whenever the buffers fill, up to ``L + budget``: a step reads the
    first ``K`` columns of every row, and rows much wider than ``K`` make that read strided.
    A step past the budget is an error.
    """

    COMPACT_BELOW = 0.75
    """Compact the buffers once fewer than this share of their rows is live."""

    SPAN_COLUMNS = 128
    """On static shapes (``decode=graph``) a step attends over the first 128, 256, 512, ...
    columns (:meth:`span`)."""

    GROW_COLUMNS = 8
    """Columns of room the buffers get at a time (at prefill, and whenever they fill)."""

    def __init__(
        self,
        model: PreTrainedModel,
        static_shapes: bool = False,
        graphs: bool = False,
        eager_if_capture_fails: bool = False,
        attention: Literal["sdpa", "matmul"] | None = None,
    ):
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
        self.passes: list[LayerPass] = []  # the turn's layers, weights prepared (see prefill)
        self._tables: tuple[torch.Tensor, ...] = ()  # the turn's rotary cos, signed sin [W, D]
        # static shapes: whole-budget buffers, a step's column in a tensor, attention over
        # its span of columns; graphs: each step replayed from a CUDA graph of its span
        self.graphs = graphs
        self.static_shapes = static_shapes or graphs
        self.eager_if_capture_fails = eager_if_capture_fails  # else a failed capture raises
        self._graph: tuple[int, _StepGraph] | None = None  # the current span's, and its span
        if attention not in (None, "sdpa", "matmul"):
            raise ValueError(f"attention must be sdpa or matmul, got {attention!r}")
        self.attention = attention
        self.sdpa = attention == "sdpa"  # the turn's choice (attention None: set at prefill)

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, budget: int
    ) -> torch.Tensor:
        b, length = ids.shape
        limit = length + budget  # the keep mask's width; the buffers grow towards it
        width = limit if self.static_shapes else min(limit, length + self.GROW_COLUMNS)
        device = ids.device
        if self.graphs and not _StepGraph.runs_on(device):
            raise ValueError(
                f"decode=graph replays CUDA graphs, but the model is on {device}; "
                "use decode=auto or static"
            )
        self._graph = None
        half = self.inner.embed_tokens.weight.dtype in (torch.bfloat16, torch.float16)
        self.sdpa = self.attention == "sdpa" or (
            self.attention is None and device.type == "cpu" and half
        )
        self.passes = decode_layers(self.inner, b)  # weights fixed for the turn: prepare once
        # positions stay below `limit` (a row's position is at most its column): the turn's
        # rotary tables once, each step indexes them (not for a RoPE whose frequencies
        # depend on the longest position seen: those are computed per step, as the model does)
        self._tables = ()
        if static_rope(self.inner):
            at = torch.arange(limit, device=device)[None]
            cos, sin = rotary_tables(self.inner, self.inner.embed_tokens.weight, at)
            self._tables = (cos[0], sin[0])
        # a context that several rows share (n samples of one prompt) is run once, and its
        # keys and values are copied to every row that has it
        distinct, copy_of = distinct_rows(list(map(tuple, torch.cat([ids, mask], 1).tolist())))
        shared = len(distinct) < b
        self.keys, self.values = self._buffers(len(distinct), length if shared else width, device)
        self.keep = torch.zeros((len(distinct), limit), dtype=torch.bool, device=device)
        self.keep[:, :length] = mask[distinct].bool()
        # causal and padding mask; a padding query attends to itself so no row is empty
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        attend = causal[None] & self.keep[:, None, :length]
        attend |= torch.eye(length, dtype=torch.bool, device=device)[None]
        embedded = self.inner.embed_tokens(ids[distinct])
        hidden = self._layers(embedded, pos[distinct], attend[:, None], 0, length)
        logits = self._logits(hidden[:, -1:, :])
        self.column = length
        if shared:  # every row its own buffers, with room to grow
            rows = torch.as_tensor(copy_of, device=device)
            self._rebuffer(rows, width)
            self.keep, logits = self.keep[rows], logits[rows]
        self.rows = torch.arange(b, device=device)
        return logits

    @property
    def key_axis(self) -> int:
        """The column axis of the key buffers: 2 (``[B, H_kv, W, D]``), 3 for ``matmul``."""
        return 2 if self.sdpa else 3

    def _buffers(
        self, rows: int, width: int, device: torch.device
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Key buffers (``[rows, H_kv, width, D]``, transposed to ``[rows, H_kv, D, width]``
        for ``matmul`` attention) and value buffers ``[rows, H_kv, width, D]``, one of each
        per layer: uninitialised, or zeros on static shapes (a step there multiplies every
        column, and a masked column must hold no NaN)."""
        dtype, layers = self.inner.embed_tokens.weight.dtype, len(self.inner.layers)
        values = (rows, self.kv_heads, width, self.head_dim)
        keys = values if self.sdpa else (rows, self.kv_heads, self.head_dim, width)
        new = torch.zeros if self.static_shapes else torch.empty
        return (
            [new(keys, device=device, dtype=dtype) for _ in range(layers)],
            [new(values, device=device, dtype=dtype) for _ in range(layers)],
        )

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if len(tokens) != len(self.rows):
            raise ValueError(f"{len(tokens)} tokens for {len(self.rows)} live rows")
        column = self.column
        if column >= self.keep.shape[1]:
            raise RuntimeError(
                f"the static cache is full ({column} columns): a step past the budget"
            )
        if column >= self.values[0].shape[2]:  # the buffers are full: room for more columns
            self._rebuffer(None, min(self.keep.shape[1], column + self.GROW_COLUMNS))
        if len(self.rows) < self.keep.shape[0]:  # finished rows still in the buffers
            full = torch.zeros(self.keep.shape[0], dtype=tokens.dtype, device=tokens.device)
            tokens = full.index_copy(0, self.rows, tokens)
            pos = torch.zeros_like(full).index_copy(0, self.rows, pos)
        if self.static_shapes:
            logits = self._static_step(tokens, pos, column)
        else:
            logits = self._step_at(tokens, pos, column)
        self.column = column + 1
        return logits if len(self.rows) == len(logits) else logits[self.rows]

    def _static_step(self, tokens: torch.Tensor, pos: torch.Tensor, column: int) -> torch.Tensor:
        """A step on static shapes, its column given as a tensor, attending over the first
        :meth:`span` columns; with ``graphs``, replayed from the graph of that span (captured
        at its first step: with graphs the buffers neither grow nor compact, so one graph
        per span serves the turn)."""
        at, span = torch.tensor([column], device=tokens.device), self.span(column)
        if not self.graphs:
            return self._step_at(tokens, pos, at, span)
        if self._graph is None or self._graph[0] != span:
            try:
                graph = _StepGraph(functools.partial(self._step_at, span=span), tokens, pos, at)
            except RuntimeError as error:
                if not self.eager_if_capture_fails:
                    raise
                # the eager step on the same static shapes (the buffers hold what the
                # capture's warm-up wrote: this very step's column, written again)
                warnings.warn(
                    f"capturing the decode step as a CUDA graph failed ({error}); "
                    "decoding without graphs (decode=static)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self.graphs = False
                _CAPTURE_FAILED.add(self.model)
                return self._step_at(tokens, pos, at, span)
            self._graph = (span, graph)  # columns only grow: the earlier span is done
        return self._graph[1].replay(tokens, pos, at)

    def span(self, column: int) -> int:
        """The columns a static-shape step at ``column`` attends over: the smallest of
        ``SPAN_COLUMNS`` times a power of two that is past ``column``, at most the buffers'
        width. A step reads ``span`` columns of every row's keys and values, so a turn
        whose budget is far above its lengths reads at most about twice what it wrote,
        for one graph per span (a few for a long budget)."""
        span = self.SPAN_COLUMNS
        while span <= column:
            span *= 2
        return min(span, self.values[0].shape[2])

    def _step_at(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        at: int | torch.Tensor,
        span: int | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, V]`` of every buffer row after ``tokens[B]`` at positions ``pos[B]``,
        written to column ``at``: an int attends over the columns up to it; a tensor
        (``[1]``, static shapes, every operand a tensor) over the first ``span`` columns of
        the buffers, those not kept masked."""
        if isinstance(at, torch.Tensor):
            self.keep.index_fill_(1, at, True)
            seen = self.keep[:, :span]
        else:
            self.keep[:, at] = True
            seen = self.keep[:, : at + 1]
        attend = seen[:, None, None, :]
        hidden = self._layers(self.inner.embed_tokens(tokens[:, None]), pos[:, None], attend, at, 1)
        return self._logits(hidden)

    def select(self, index: torch.Tensor) -> None:
        self.rows = self.rows[index.to(self.rows.device)]
        # with graphs the finished rows stay: a compaction would mean a new capture, which
        # costs a few steps, while a replay costs about one launch whatever the rows
        if self.graphs or len(self.rows) >= self.COMPACT_BELOW * self.keep.shape[0]:
            return
        self._rebuffer(self.rows, self.values[0].shape[2])
        self.keep = self.keep[self.rows]
        self.rows = torch.arange(len(self.rows), device=self.rows.device)

    def _rebuffer(self, rows: torch.Tensor | None, width: int) -> None:
        """New buffers ``width`` columns wide holding the written columns of ``rows`` (all
        rows when None): compaction and growth copy only what the steps have written."""
        n, written = len(self.keep) if rows is None else len(rows), self.column
        pick = slice(None) if rows is None else rows
        keys, values = self._buffers(n, width, self.keep.device)
        for new, old in zip(keys, self.keys, strict=True):
            new.narrow(self.key_axis, 0, written).copy_(old.narrow(self.key_axis, 0, written)[pick])
        for new, old in zip(values, self.values, strict=True):
            new[:, :, :written] = old[:, :, :written][pick]
        self.keys, self.values = keys, values

    def _layers(
        self,
        hidden: torch.Tensor,
        pos: torch.Tensor,
        attend: torch.Tensor,
        start: int | torch.Tensor,
        n: int,
    ) -> torch.Tensor:
        """Run every decoder layer on ``hidden[B, n, H]`` at positions ``pos[B, n]``,
        writing keys and values to columns ``start .. start + n``; ``attend[B, 1, n, K]``
        (bool) says which of the first ``K`` columns each query sees (``K = start + n``
        for an int ``start``). A tensor ``start`` (``[1]``, with ``n = 1``) is the
        static-shape step: its column is written in place, and ``K`` is its span."""
        b = hidden.shape[0]
        cos, sin = self._rotary(hidden, pos)
        static = isinstance(start, torch.Tensor)
        end = attend.shape[-1]  # the columns attended
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads  # query heads per key/value head
        # the query heads of a key/value head are folded into the query axis, [group * n]
        if self.sdpa:
            mask = attend.repeat(1, 1, group, 1) if group > 1 else attend
        else:
            bias = _bias(attend, hidden.dtype)  # [B, 1, n, K]
            if n == 1:  # a step: [B * H_kv, group, K], added inside each layer's product
                bias = bias[:, :, None].expand(b, kv_heads, group, n, end).reshape(-1, group, end)
        for layer, keys, values in zip(self.passes, self.keys, self.values, strict=True):
            q, k, v = layer.project(hidden, cos, sin)  # [B, n, heads | kv, D]
            width = values.shape[2]
            k_in = k.transpose(1, 2) if self.sdpa else k.permute(0, 2, 3, 1)
            if static:
                keys.index_copy_(self.key_axis, start, k_in)
                values.index_copy_(2, start, v.transpose(1, 2))
            else:
                keys.narrow(self.key_axis, start, n).copy_(k_in)
                values[:, :, start : start + n] = v.transpose(1, 2)
            q = q.transpose(1, 2).reshape(b, kv_heads, group * n, d)
            if self.sdpa:  # on column slices of the buffers (no copy of the cache)
                out = scaled_dot_product_attention(
                    q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, scale=self.scaling
                )
            else:  # [B * H_kv, group * n, D] @ [B * H_kv, D, K] -> scores [B, H, n, K]
                q = q.reshape(b * kv_heads, group * n, d)
                k_seen = keys.view(b * kv_heads, d, width)[..., :end]
                v_seen = values.view(b * kv_heads, width, d)[:, :end]
                if n == 1:  # scale and mask in the product: one operator where three were
                    scores = torch.baddbmm(bias, q, k_seen, alpha=self.scaling)
                else:  # the prefill: its [n, K] mask broadcast over the heads, not copied
                    scores = torch.bmm(q, k_seen).view(b, heads, n, end)
                    scores = scores.mul_(self.scaling).add_(bias).view(b * kv_heads, -1, end)
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
                probs = probs if probs.dtype == scores.dtype else probs.to(scores.dtype)
                out = torch.bmm(probs, v_seen)
            out = out.view(b, heads, n, d).transpose(1, 2).reshape(b, n, heads * d)
            hidden = layer.finish(hidden, out)
        return hidden

    def _rotary(self, hidden: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables ``cos``, ``signed_sin`` ``[B, n, 1, D]`` (one for every head) of
        positions ``pos[B, n]`` for ``hidden`` (its dtype): looked up in the turn's tables
        (bitwise the values the rotary module computes per step), else computed."""
        if not self._tables:
            cos, sin = rotary_tables(self.inner, hidden, pos)
            return cos[:, :, None], sin[:, :, None]
        try:
            cos, sin = (embedding(pos, table)[:, :, None] for table in self._tables)
        except IndexError as error:  # on the CPU; the sampler's positions never get here
            raise ValueError(
                f"a position past the turn's {len(self._tables[0])} (prompt width + budget): "
                "a row's position grows by one a step from its position at the prefill"
            ) from error
        return cos, sin

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` logits of the last position of ``hidden[B, n, H]``."""
        return self.model.lm_head(self.inner.norm(hidden[:, -1, :]))


class _StepGraph:
    """One decode step captured as a CUDA graph.

    ``step(tokens, pos, at)`` must read and write only tensors whose storage stays put
    between replays (the decoder's buffers and keep mask) besides its three arguments,
    which are copied into the graph's own input tensors before each replay. Capturing runs
    the step once eagerly on a side stream first (CUDA's rule for capture); the step is
    idempotent for the same inputs (it writes the same column), so that run, the capture
    and the replay leave the buffers as one step would.
    """

    def __init__(
        self,
        step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        tokens: torch.Tensor,
        pos: torch.Tensor,
        at: torch.Tensor,
    ) -> None:
        self.tokens, self.pos, self.at = tokens.clone(), pos.clone(), at.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(self.tokens, self.pos, self.at)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step(self.tokens, self.pos, self.at)

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        """Whether steps on ``device`` can be captured (CUDA only)."""
        return device.type == "cuda"

    def replay(self, tokens: torch.Tensor, pos: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """The step's logits ``[B, V]`` for these inputs (a copy: the graph's output tensor
        is overwritten by the next replay)."""
        self.tokens.copy_(tokens)
        self.pos.copy_(pos)
        self.at.copy_(at)
        self.graph.replay()
        return self.logits.clone()
