"""The static-cache decoder against the model's own forward: logits, sampled tokens,
grouped-query attention, attention biases, row selection; the choice of decoder."""

from __future__ import annotations

import copy
import warnings
import weakref

import pytest
import torch
from helpers import llama_variants
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from anchor_rl.models import packed
from anchor_rl.models.llama import FrozenLayer, static_rope
from anchor_rl.models.packed import PackedProduct
from anchor_rl.models.padding import left_pad, position_ids
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.rollout import decoders
from anchor_rl.rollout.decoders import (
    HFDecoder,
    StaticDecoder,
    cache_argument,
    decoder_for,
    static_unsupported,
)
from anchor_rl.rollout.engine import HFEngine
from anchor_rl.rollout.sampling import StopSet, eos_ids, generate_turn

TOK = build_tokenizer()
MODELS = llama_variants(TOK)
CONTEXTS = [[5, 20, 21, 30, 31, 32, 7], [40, 41], [9, 9, 60, 61, 62], [70, 71, 72, 73]]


REPEATED = [CONTEXTS[0], CONTEXTS[1], CONTEXTS[0], CONTEXTS[0]]  # two samples' prompts
STEPS = [[11, 12, 13, 14], [15, 16, 17, 18], [19, 20, 21], [22, 23], [24]]
KEEP = [None, None, [0, 1, 3], [0, 2], [1]]  # rows finish: compaction below 3/4 live


def _contexts(name: str, contexts, pack: bool, monkeypatch) -> tuple:
    """``(model, ids, mask, pos)``: model ``name`` in eval mode (every projection packed for
    oneDNN when ``pack``: the threshold lowered to 1, these weights being below the real
    one) and the left-padded ``contexts`` with their position ids."""
    if pack:
        monkeypatch.setattr(packed, "ENABLED", True)
        monkeypatch.setattr(packed, "PACK_MIN_ELEMENTS", 1)
    ids, mask = left_pad(contexts, TOK.pad_token_id)
    return MODELS[name].eval(), ids, mask, position_ids(mask)


def _steps_agree(fast, slow, pos: torch.Tensor, vocab: int) -> list[int]:
    """Run :data:`STEPS` with the selections :data:`KEEP` on both prefilled decoders from
    the contexts' positions ``pos[B, L]``, asserting equal logits (1e-5) at each step;
    the fast decoder's buffer width at each step."""
    widths = []
    pos = pos[:, -1]
    for tokens, index in zip(STEPS, KEEP, strict=True):
        if index is not None:
            index = torch.tensor(index)
            fast.select(index)
            slow.select(index)
            pos = pos[index]
        pos = pos + 1
        tokens = torch.tensor(tokens)
        a, b = fast.step(tokens, pos), slow.step(tokens, pos)
        widths.append(fast.values[0].shape[2])
        assert a.shape == b.shape == (len(tokens), vocab)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    return widths


ATTENTION = pytest.mark.parametrize("attention", ["sdpa", "matmul"])
"""Both attentions over the buffers: the CPU's default (sdpa) and CUDA's (matmul)."""


@ATTENTION
@pytest.mark.parametrize("grow", [16, 2], ids=["room", "growing"])  # budget: 8 steps
@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("contexts", [CONTEXTS, REPEATED], ids=["distinct", "repeated"])
@pytest.mark.parametrize("name", list(MODELS))
def test_static_logits_equal_the_models_own_forward_through_steps_and_selection(
    name, contexts, pack, grow, attention, monkeypatch
) -> None:
    """Also with every projection's weight packed for oneDNN (the threshold lowered to 1:
    these models' weights are below the real one), and with buffers that start with room
    for all 8 steps (16) or grow 2 columns at a time (before, between and after the
    compactions)."""
    monkeypatch.setattr(StaticDecoder, "GROW_COLUMNS", grow)
    model, ids, mask, pos = _contexts(name, contexts, pack, monkeypatch)
    fast, slow = StaticDecoder(model, attention=attention), HFDecoder(model)
    embedded: list[int] = []  # rows the prefill runs through the layers
    hook = model.model.embed_tokens.register_forward_hook(
        lambda _m, args, _out: embedded.append(len(args[0]))
    )
    with torch.no_grad():
        a = fast.prefill(ids, mask, pos, 8)
        hook.remove()
        assert all(isinstance(layer, FrozenLayer) for layer in fast.passes)
        products = [
            p for layer in fast.passes for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        assert all(isinstance(p, PackedProduct) == pack for p in products)
        b = slow.prefill(ids, mask, pos, 8)
        assert embedded == [len({tuple(c) for c in contexts})]  # each context once
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        widths = _steps_agree(fast, slow, pos, model.config.vocab_size)
    length = ids.shape[1]
    if grow == 2:  # 2 columns of room, then 2 more each time the buffers fill
        assert widths == [length + 2, length + 2, length + 4, length + 4, length + 6]
    else:  # room for the whole budget of 8 from the start
        assert widths == [length + 8] * 5


@ATTENTION
@pytest.mark.parametrize("span", [128, 4], ids=["one-span", "spans"])
@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("contexts", [CONTEXTS, REPEATED], ids=["distinct", "repeated"])
@pytest.mark.parametrize("name", list(MODELS))
def test_static_shape_steps_equal_the_models_own_forward(
    name, contexts, pack, span, attention, monkeypatch
):
    """The steps ``decode=graph`` captures, run eagerly: whole-budget buffers (zeros where
    nothing is written yet), each step's column given as a tensor and attention over its
    span of columns (the whole width, or 8 then 16 of 15 with spans of 4), through
    selections and compactions, give the model's own logits."""
    monkeypatch.setattr(StaticDecoder, "SPAN_COLUMNS", span)
    model, ids, mask, pos = _contexts(name, contexts, pack, monkeypatch)
    fast, slow = StaticDecoder(model, static_shapes=True, attention=attention), HFDecoder(model)
    width = ids.shape[1] + 8
    with torch.no_grad():
        torch.testing.assert_close(
            fast.prefill(ids, mask, pos, 8), slow.prefill(ids, mask, pos, 8), rtol=0, atol=1e-5
        )
        assert fast.values[0].shape[2] == width and not fast.values[0][:, :, -1].any()
        widths = _steps_agree(fast, slow, pos, model.config.vocab_size)
    assert widths == [width] * len(STEPS)  # never grown
    assert fast.keys[0].shape[0] < len(contexts)  # the buffers were compacted on the way


def test_graph_decoding_keeps_finished_rows_in_its_buffers() -> None:
    """With graphs a selection never compacts (a compaction would cost a new capture): the
    buffers stay, the live rows index them, and the static-shape step still gives the
    model's own logits for the live rows."""
    model = MODELS["tiny"].eval()
    ids, mask = left_pad(CONTEXTS, TOK.pad_token_id)
    pos = position_ids(mask)
    fast, slow = StaticDecoder(model, static_shapes=True), HFDecoder(model)
    with torch.no_grad():
        fast.prefill(ids, mask, pos, 4)
        slow.prefill(ids, mask, pos, 4)
        buffers = fast.keys[0]
        fast.graphs = True  # what decode=graph sets; its steps need CUDA, its selection not
        index = torch.tensor([2])  # one live row of four: a compaction without graphs
        fast.select(index)
        slow.select(index)
        assert fast.keys[0] is buffers and fast.rows.tolist() == [2]
        fast.graphs = False
        step = (torch.tensor([11]), pos[index, -1] + 1)
        torch.testing.assert_close(fast.step(*step), slow.step(*step), rtol=0, atol=1e-5)


def test_graph_decoding_needs_a_cuda_model() -> None:
    model = MODELS["tiny"].eval()
    decoder = decoder_for(model, "graph")
    assert isinstance(decoder, StaticDecoder) and decoder.graphs and decoder.static_shapes
    stops = StopSet.build(TOK, [], eos_ids(model, TOK))
    with pytest.raises(
        ValueError, match="decode=graph replays CUDA graphs, but the model is on cpu"
    ):
        generate_turn(model, TOK, CONTEXTS, [4] * 4, 1.0, 1.0, stops, [0] * 4, [0] * 4, "graph")
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(TOK)))
    with pytest.raises(ValueError, match="decode=graph cannot run GPT2LMHeadModel"):
        decoder_for(gpt2, "graph")


class EagerGraph:
    """``_StepGraph``'s contract on the CPU: inputs copied into the graph's own tensors, the
    step run on those at every replay, and the buffers it wrote at capture the ones every
    replay writes (a real graph keeps writing the storage it was captured on)."""

    made: list[EagerGraph] = []

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return True

    def __init__(self, step, tokens, pos, at) -> None:
        self.step, self.replays = step, 0
        self.tokens, self.pos, self.at = tokens.clone(), pos.clone(), at.clone()
        step(self.tokens, self.pos, self.at)  # the warm-up run before a capture
        self.storage = self._storage()
        EagerGraph.made.append(self)

    def _storage(self) -> list[int]:
        decoder = self.step.func.__self__  # step: functools.partial(decoder._step_at, span=...)
        return [t.data_ptr() for t in [decoder.keep, *decoder.keys, *decoder.values]]

    def replay(self, tokens, pos, at) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.pos.copy_(pos)
        self.at.copy_(at)
        assert self._storage() == self.storage, "the buffers moved after the capture"
        self.replays += 1
        return self.step(self.tokens, self.pos, self.at).clone()


class FailingCapture(EagerGraph):
    def __init__(self, step, tokens, pos, at) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")


def _turns(mode: str) -> list:
    model = MODELS["tiny"].eval()
    stops = StopSet.build(TOK, [], eos_ids(model, TOK))
    n = 4 * len(CONTEXTS)
    budgets = [30, 5, 17, 30] * 4
    return generate_turn(
        model, TOK, CONTEXTS * 4, budgets, 1.0, 1.0, stops, list(range(n)), [0] * n, decode=mode
    )


def _same_turns(fast: list, slow: list) -> None:
    for a, b in zip(fast, slow, strict=True):
        assert a.tokens == b.tokens and a.stop == b.stop
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("span", [128, 8])
def test_graph_decoding_captures_once_a_span_and_samples_the_static_tokens(
    span, monkeypatch
) -> None:
    """decode=graph's bookkeeping with the capture stood in for (``EagerGraph``): one
    capture at the first step of each span (one for the turn when its budget fits in 128
    columns; with spans of 8, 16, 32, ... columns, one for each), every step a replay on
    the graph's own inputs with the buffers it was captured on, and the tokens of
    decode=static."""
    monkeypatch.setattr(decoders, "_StepGraph", EagerGraph)
    monkeypatch.setattr(EagerGraph, "made", [])
    monkeypatch.setattr(StaticDecoder, "SPAN_COLUMNS", span)
    graph = _turns("graph")
    _same_turns(graph, _turns("static"))
    context = max(map(len, CONTEXTS))  # left-padded: every row starts writing here
    width = context + 30  # the longest budget
    columns = range(context, context + max(len(t.tokens) for t in graph) - 1)
    spans = {min(width, next(span * 2**k for k in range(8) if span * 2**k > c)) for c in columns}
    assert len(EagerGraph.made) == len(spans) == (1 if span == 128 else 4)
    assert sum(g.replays for g in EagerGraph.made) == len(columns)


def test_auto_decodes_with_graphs_where_they_run_and_eagerly_after_a_failed_capture(
    monkeypatch,
) -> None:
    model = MODELS["tiny"].eval()
    assert not decoder_for(model).graphs  # on the CPU auto is static
    monkeypatch.setattr(decoders, "_CAPTURE_FAILED", weakref.WeakSet())
    monkeypatch.setattr(decoders, "_StepGraph", FailingCapture)  # a device that replays graphs
    auto = decoder_for(model)
    assert auto.graphs and auto.eager_if_capture_fails
    with pytest.warns(RuntimeWarning, match="decoding without graphs"):
        turns = _turns("auto")
    _same_turns(turns, _turns("static"))
    assert not decoder_for(model).graphs  # the model decodes eagerly from then on
    with pytest.raises(RuntimeError, match="stream is capturing"):
        _turns("graph")  # asked for by name, a failed capture is an error


def test_generate_turn_samples_the_same_tokens_with_either_decoder() -> None:
    static = _turns("static")
    _same_turns(static, _turns("hf"))
    assert sorted({len(t.tokens) for t in static}) != [30]  # rows ended apart


def test_static_cache_refuses_a_step_past_its_budget() -> None:
    model = MODELS["tiny"].eval()
    ids, mask = left_pad(CONTEXTS, TOK.pad_token_id)
    decoder = StaticDecoder(model)
    with torch.no_grad():
        pos = position_ids(mask)[:, -1]
        decoder.prefill(ids, mask, position_ids(mask), 1)
        decoder.step(torch.ones(4, dtype=torch.long), pos + 1)
        with pytest.raises(RuntimeError, match="full"):
            decoder.step(torch.ones(4, dtype=torch.long), pos + 2)


def test_a_step_position_past_the_turns_rotary_tables_is_a_clear_error() -> None:
    """Positions grow by one a step from the prefill's (as the sampler's do): one past the
    prompt width + budget has no rotary table row, and says so."""
    model = MODELS["tiny"].eval()
    ids, mask = left_pad(CONTEXTS, TOK.pad_token_id)
    decoder = StaticDecoder(model)
    with torch.no_grad():
        decoder.prefill(ids, mask, position_ids(mask), 2)
        with pytest.raises(ValueError, match="prompt width \\+ budget"):
            decoder.step(torch.ones(4, dtype=torch.long), torch.full((4,), ids.shape[1] + 2))


def test_a_dynamic_rope_is_computed_per_step_as_the_model_computes_it() -> None:
    """transformers recomputes a dynamic RoPE's frequencies from the longest position of a
    call, so the turn's tables would rotate every position as the last one scales it: such a
    RoPE is computed step by step, and the decoder stays the model's own forward past the
    original 8 positions (the reference decoder on its own copy: the module keeps state)."""
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config = LlamaConfig(
        **small, vocab_size=len(TOK), max_position_embeddings=8, rope_parameters=dynamic
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    assert not static_rope(model.model) and static_rope(MODELS["tiny"].model)
    ids, mask = left_pad(CONTEXTS, TOK.pad_token_id)
    pos = position_ids(mask)
    fast, slow = StaticDecoder(model), HFDecoder(copy.deepcopy(model))
    with torch.no_grad():
        a, b = fast.prefill(ids, mask, pos, 8), slow.prefill(ids, mask, pos, 8)
        assert fast._tables == ()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        _steps_agree(fast, slow, pos, config.vocab_size)  # positions 7 to 11


def test_bf16_decoding_with_either_attention_stays_near_the_float32_logits() -> None:
    """A bfloat16 copy of a model decodes through prefill, steps and selections with logits
    as near the float32 model's as its own forward's (``transformers``' in bfloat16):
    either attention over the buffers adds no error of its own beyond bfloat16's."""
    model = MODELS["tiny"].eval()
    half = copy.deepcopy(model).to(torch.bfloat16)
    ids, mask = left_pad(CONTEXTS, TOK.pad_token_id)
    pos = position_ids(mask)
    decoders = {
        "exact": HFDecoder(model),
        "hf": HFDecoder(half),
        "sdpa": StaticDecoder(half, attention="sdpa"),
        "matmul": StaticDecoder(half, attention="matmul"),
    }
    errors: dict[str, float] = {name: 0.0 for name in decoders}
    with torch.no_grad():
        logits = {k: d.prefill(ids, mask, pos, 8).float() for k, d in decoders.items()}
        at = pos[:, -1]
        for tokens, index in [(None, None), *zip(STEPS, KEEP, strict=True)]:
            if tokens is not None:
                if index is not None:
                    index = torch.tensor(index)
                    for d in decoders.values():
                        d.select(index)
                    at = at[index]
                at = at + 1
                step = (torch.tensor(tokens), at)
                logits = {k: d.step(*step).float() for k, d in decoders.items()}
            for name in decoders:
                error = (logits[name] - logits["exact"]).abs().max().item()
                errors[name] = max(errors[name], error)
    assert 0 < errors["hf"] < 0.1
    assert errors["sdpa"] < 2 * errors["hf"] and errors["matmul"] < 2 * errors["hf"]


def test_a_bf16_model_on_the_cpu_attends_with_sdpa_unless_told_otherwise() -> None:
    """``attention=None`` picks the fused kernel for a bfloat16 CPU model at the prefill,
    with keys ``[B, H_kv, W, D]``, and the batched matmuls (keys transposed) for a float32
    one or when named; other names are refused."""
    ids, mask = left_pad(CONTEXTS, TOK.pad_token_id)
    layouts = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = copy.deepcopy(MODELS["tiny"]).to(dtype).eval()
        for attention in (None, "matmul"):
            decoder = StaticDecoder(model, attention=attention)
            with torch.no_grad():
                decoder.prefill(ids, mask, position_ids(mask), 4)
            same_layout = decoder.keys[0].shape == decoder.values[0].shape
            layouts[str(dtype)[6:], attention] = (decoder.sdpa, same_layout)
    assert layouts == {
        ("float32", None): (False, False),
        ("float32", "matmul"): (False, False),
        ("bfloat16", None): (True, True),
        ("bfloat16", "matmul"): (False, False),
    }
    with pytest.raises(ValueError, match="attention must be sdpa or matmul"):
        StaticDecoder(model, attention="flash")


def test_decoder_choice_falls_back_or_names_why() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(TOK)))
    assert "model_type 'gpt2'" in static_unsupported(gpt2)
    assert isinstance(decoder_for(gpt2), HFDecoder)
    assert isinstance(decoder_for(MODELS["tiny"]), StaticDecoder)
    assert isinstance(decoder_for(MODELS["tiny"], "hf"), HFDecoder)
    with pytest.raises(ValueError, match="decode=static cannot run GPT2LMHeadModel"):
        decoder_for(gpt2, "static")
    with pytest.raises(ValueError, match="decode must be one of"):
        HFEngine(MODELS["tiny"], TOK, decode="fast")
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=len(TOK))
    sliding = LlamaConfig(num_attention_heads=4, **small)
    sliding.model_type = "mistral"
    sliding.sliding_window = 16
    assert "sliding-window" in static_unsupported(LlamaForCausalLM(sliding))


def test_the_hf_decoder_passes_the_cache_under_the_name_its_transformers_uses() -> None:
    """transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns); a
    forward that knows only the old name (earlier 5.x, the scripted test model) gets it."""
    model = MODELS["tiny"].eval()
    stops = StopSet.build(TOK, [], eos_ids(model, TOK))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        turns = generate_turn(
            model, TOK, CONTEXTS, [6] * 4, 1.0, 1.0, stops, [0] * 4, [0] * 4, "hf"
        )
    static = generate_turn(model, TOK, CONTEXTS, [6] * 4, 1.0, 1.0, stops, [0] * 4, [0] * 4)
    assert [t.tokens for t in turns] == [t.tokens for t in static]

    class OldForward(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None): ...

    assert cache_argument(OldForward()) == "past_key_values"


def test_a_static_shape_step_attends_over_a_power_of_two_span_of_columns() -> None:
    model = MODELS["tiny"].eval()
    ids, mask = left_pad(CONTEXTS, TOK.pad_token_id)
    decoder = StaticDecoder(model, static_shapes=True)
    with torch.no_grad():
        decoder.prefill(ids, mask, position_ids(mask), 993)  # 1,000 columns wide
    assert decoder.values[0].shape[2] == 1000
    spans = [decoder.span(c) for c in (0, 7, 127, 128, 255, 256, 511, 512, 999)]
    assert spans == [128, 128, 128, 256, 256, 512, 512, 1000, 1000]
