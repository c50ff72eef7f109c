"""One generation turn for a batch of contexts: KV-cached sampling with per-row stops.

The log-prob returned for each sampled token is its log-probability under the
distribution it was actually drawn from: ``log_softmax(logits / temperature)``,
restricted to the top-p nucleus and renormalised over it. At temperature 1 and top-p 1
that is the model's own log-prob, the value ``token_logprobs`` recomputes; at
temperature 0 (greedy) the distribution is a point mass and the log-prob is 0.

Randomness is per row: the t-th token of a response is drawn by inverse-CDF sampling
with the uniform number :func:`uniforms` derives from the response's own seed and t
(a counter-based generator, splitmix64). A response therefore never depends on which
other responses share its batch, how the batch is chunked, or which process samples it
-- up to the floating-point rounding of the forward pass, which a different batch
shape may change in the last bits (and, rarely, so a token whose uniform falls within
that rounding of a CDF boundary).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.models.padding import left_pad, position_ids
from anchor_rl.rollout.decoders import DecodeMode, decoder_for

EOS = "<eos>"


@dataclass
class Turn:
    """What one row generated in one turn.

    stop: the stop string that ended the turn, ``EOS`` for an eos token, or ``None``
    when the row's token budget ran out first.
    """

    tokens: list[int]
    logprobs: list[float]
    stop: str | None


@dataclass(frozen=True)
class StopSet:
    """The ways a turn ends: an eos token, or a stop string appearing in the decoded text.

    Stop strings are matched on text, as OpenAI-compatible servers match ``stop``: a stop
    ends the turn whether it is one token, spelled by several, or inside a longer token's
    text (``"\\n"`` inside a ``"\\n\\n"`` token, ``">"`` inside ``"</answer>"``). The text
    is decoded only after a token that can complete a stop (:func:`quiet_tokens`: the
    others are ``quiet``), so a turn decodes a few times rather than once a token.

    eos: the eos ids; they end a turn as :data:`EOS`.
    strings: the stop strings, in the order given.
    quiet: the token ids after which no stop string can newly appear.
    """

    eos: frozenset[int]
    strings: tuple[str, ...]
    quiet: frozenset[int]

    @staticmethod
    def build(
        tokenizer: PreTrainedTokenizerBase, stop: Sequence[str], eos_ids: Sequence[int]
    ) -> StopSet:
        strings = tuple(dict.fromkeys(stop))
        if any(not s for s in strings):
            raise ValueError("empty stop string")
        quiet = quiet_tokens(tokenizer, strings) if strings else frozenset()
        return StopSet(frozenset(int(i) for i in eos_ids), strings, quiet)

    def match(self, tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str | None:
        """What the last token of ``ids`` (non-empty) ends the turn with: ``EOS`` for an eos
        id, else the stop string it makes appear (:meth:`string_stop`), else None."""
        last = ids[-1]
        if last in self.eos:
            return EOS
        if not self.strings or last in self.quiet:
            return None
        return self.string_stop(tokenizer, ids)

    def string_stop(self, tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str | None:
        """The stop string in the decoded tail of ``ids`` that starts first (the first listed
        of those starting at the same place), None if none: cutting the text there leaves no
        stop in it. The tail is long enough to hold any stop whatever the tokenizer: a token
        spells at least one byte (a byte-level or byte-fallback tokenizer may spend four
        tokens on one character), so it is the longest stop's UTF-8 bytes plus two tokens."""
        if not self.strings:
            return None
        window = max(len(s.encode("utf-8")) for s in self.strings) + 2
        tail = tokenizer.decode(list(ids[-window:]))
        found = [(at, i) for i, s in enumerate(self.strings) if (at := tail.find(s)) >= 0]
        return self.strings[min(found)[1]] if found else None


@functools.lru_cache(maxsize=32)
def quiet_tokens(tokenizer: PreTrainedTokenizerBase, strings: tuple[str, ...]) -> frozenset[int]:
    """The token ids after which none of the stop ``strings`` can newly appear in a text.

    A stop newly appears only if it ends inside the new token's text: it lies within that
    text, or it began earlier and a prefix of the text is a suffix of it. A token is quiet
    when neither holds for any stop, its text is known (:func:`token_texts`) and it holds
    no byte of an unfinished character (``\\ufffd``: byte-level tokens complete characters
    in context). Cached per tokenizer and stops (a run's stops are the same every turn)."""

    def may_end(text: str) -> bool:
        return any(
            stop in text
            or any(stop.endswith(text[:p]) for p in range(1, min(len(text), len(stop)) + 1))
            for stop in strings
        )

    return frozenset(
        i
        for i, text in enumerate(token_texts(tokenizer))
        if text is not None and "\ufffd" not in text and not may_end(text)
    )


@functools.lru_cache(maxsize=8)
def token_texts(tokenizer: PreTrainedTokenizerBase) -> tuple[str | None, ...]:
    """The text each token id adds to a decoded text (index: the id; ``len(tokenizer)``
    ids), read as what decoding it after a plain ``a`` appends: decoding a token alone
    loses a leading space in SentencePiece tokenizers. None where the decoded pair does not
    start with the ``a`` (clean-up rules that rewrite across tokens), or for every id when
    ``a`` is not one token: such texts are unknown, and :class:`StopSet` decodes after
    them. Cached per tokenizer (a large vocabulary's pass takes a fraction of a second)."""
    size = len(tokenizer)
    anchor = tokenizer.encode("a", add_special_tokens=False)
    if len(anchor) != 1:
        return (None,) * size
    head = tokenizer.decode(anchor)
    pairs = tokenizer.batch_decode([[anchor[0], i] for i in range(size)])
    return tuple(text[len(head) :] if text.startswith(head) else None for text in pairs)


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokenizer's eos id plus any eos ids in the model's generation config."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif extra is not None:
        ids.update(int(i) for i in extra)
    return sorted(ids)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def uniforms(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """One uniform number in ``[0, 1)`` per row, a pure function of ``(seed, counter)``.

    splitmix64 of ``seed + (counter + 1) * golden`` (wrapping 64-bit arithmetic), its top
    53 bits as a float64. ``seeds`` are any 64-bit integers (e.g. :func:`request_seed`);
    ``counters`` count the draws of a row (its tokens so far), modulo 2^64.
    """
    z = np.asarray(seeds, dtype=np.uint64) + (np.asarray(counters, dtype=np.uint64) + 1) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logits[B, V]``.

    ``uniform[B]`` (float64 in ``[0, 1)``, one per row; required unless greedy) picks each
    row's token by inverse-CDF sampling of the processed distribution. Returns
    ``(tokens[B], logprobs[B])`` with log-probs under the processed distribution
    (temperature, then top-p renormalisation; 0 for greedy).
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    if uniform is None or uniform.shape != logits.shape[:1]:
        raise ValueError(f"sampling needs one uniform number per row ({logits.shape[0]})")
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()
        drop_sorted = mass_before >= top_p  # the top token always has mass_before 0 and stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    cdf = logp.exp().double().cumsum(-1)
    total = cdf[:, -1:]
    target = uniform.to(cdf.device, torch.float64)[:, None] * total
    tokens = torch.searchsorted(cdf, target, right=True)
    # u * total may round up to total: fall back to the last token with positive mass
    last = (cdf < total).sum(-1, keepdim=True)
    tokens = torch.minimum(tokens, last).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@torch.no_grad()
def generate_turn(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    contexts: Sequence[Sequence[int]],
    budgets: Sequence[int],
    temperature: float,
    top_p: float,
    stops: StopSet,
    seeds: Sequence[int],
    counters: Sequence[int],
    decode: DecodeMode = "auto",
) -> list[Turn]:
    """Continue each context until it hits a stop or its own token budget.

    contexts: B non-empty token lists (left-padded together; the cache holds them).
    budgets: B positive ints, the most tokens row i may generate in this turn.
    seeds, counters: B ints each: row i's t-th token of this turn is drawn with
        ``uniforms(seeds[i], counters[i] + t)`` (the counter continues across turns).
    decode: the forward pass (:func:`~anchor_rl.rollout.decoders.decoder_for`): ``auto``
        runs Llama-architecture models with a static KV cache (CUDA graphs on a GPU),
        others with their own ``forward``; ``hf``, ``static`` and ``graph`` force one.
    Rows that finish are dropped from the batch (and from the KV cache), so the others
    do not pay for them. Returns one ``Turn`` per row, in order.
    """
    if not len(contexts) == len(budgets) == len(seeds) == len(counters):
        raise ValueError(
            f"{len(contexts)} contexts, {len(budgets)} budgets, {len(seeds)} seeds and "
            f"{len(counters)} counters: one of each per row"
        )
    if any(len(c) == 0 for c in contexts):
        raise ValueError("every context needs at least one token")
    if any(b < 1 for b in budgets):
        raise ValueError("every budget must be >= 1")
    device = model.device
    ids, mask = left_pad(contexts, tokenizer.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    pos = position_ids(mask)
    decoder = decoder_for(model, decode)
    logits = decoder.prefill(ids, mask, pos, max(budgets))
    pos = pos[:, -1]
    turns = [Turn([], [], None) for _ in contexts]
    live = list(range(len(contexts)))  # original row of each batch position
    while True:
        uniform = None
        if temperature > 0:
            draws = uniforms(
                [seeds[row] for row in live],
                [(counters[row] + len(turns[row].tokens)) % 2**64 for row in live],
            )
            uniform = torch.from_numpy(draws)
        tokens, logp = sample_next(logits, temperature, top_p, uniform)
        done = []
        for row, tok, lp in zip(live, tokens.tolist(), logp.tolist(), strict=True):
            turn = turns[row]
            turn.tokens.append(tok)
            turn.logprobs.append(lp)
            turn.stop = stops.match(tokenizer, turn.tokens)
            done.append(turn.stop is not None or len(turn.tokens) >= budgets[row])
        keep = [j for j, d in enumerate(done) if not d]
        if not keep:
            return turns
        if len(keep) < len(live):
            index = torch.as_tensor(keep, device=device)
            decoder.select(index)
            pos, tokens = pos[index], tokens[index]
            live = [live[j] for j in keep]
        pos = pos + 1
        logits = decoder.step(tokens, pos)
