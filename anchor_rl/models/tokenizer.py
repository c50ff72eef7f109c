"""The built-in character-level tokenizer.

Every printable ASCII character, newline and tab is one token; the chat and tag tokens
below are single tokens too, so a model closes its answer or a tool call with one token
(the sampler also stops on a tag spelled out character by character). Characters outside that set map to ``<unk>`` (and so do not round-trip).

The chat template is deliberately terse (the built-in tiny models learn the format
from SFT, not from instructions), and it **drops system messages**: a task's
instruction is the same for every prompt, carries no information for a model trained
from scratch, and would only lengthen every prompt by its character count. A
tokenizer loaded from a Hugging Face model directory keeps its own template, which
usually does render the system message.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from anchor_rl.tools.parsing import split_tool_output

PAD, UNK, EOS = "<pad>", "<unk>", "<|end|>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, USER, ASSISTANT, SYSTEM, EOS)
TAG_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<search>",
    "</search>",
    "<result>",
    "</result>",
)
CHARACTERS: tuple[str, ...] = ("\n", "\t", *(chr(c) for c in range(32, 127)))

# One user turn, then the assistant header; system messages are not rendered.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}" + EOS + "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    + ASSISTANT
    + "{{ message['content'] }}"
    + EOS
    + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer with chat and tag tokens (vocabulary of 111).

    Ids: the six special tokens first (``<pad>`` = 0, ``<unk>`` = 1, ..., ``<|end|>`` = 5,
    which is both eos and bos), then the eight tag tokens, then the characters.
    Special tokens are dropped by ``decode(..., skip_special_tokens=True)``; tag tokens
    are not (they are part of the completion text the verifiers read).
    """
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *TAG_TOKENS, *CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=EOS,
        bos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=1024,
    )


def id_count(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    """How many token ids ``model`` reads: its embedding rows, often padded past the
    tokenizer's length (to a multiple of 64 or 128), or the tokenizer's length when that is
    larger. A sampler draws from every row's logit, so an id past the tokenizer (it decodes to
    nothing) can come out of any engine, rarely, and a later turn reads it back."""
    return max(model.get_input_embeddings().num_embeddings, len(tokenizer))


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, instruction: str | None = None
) -> list[int]:
    """Token ids of one prompt, ready for the assistant's reply.

    With a chat template: ``[system: instruction], user: prompt`` rendered with the
    generation prompt appended (the template decides what a system message becomes;
    the built-in one drops it). Without one: ``instruction + "\\n\\n" + prompt`` as plain
    text, with the tokenizer's own special tokens (e.g. bos) added.
    """
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        if instruction:
            messages.insert(0, {"role": "system", "content": instruction})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    text = f"{instruction}\n\n{prompt}" if instruction else prompt
    return tokenizer.encode(text, add_special_tokens=True)


def encode_completion(
    tokenizer: PreTrainedTokenizerBase, text: str, tool_output: bool = True
) -> tuple[list[int], list[bool]]:
    """Token ids of a finished completion and, per token, whether the policy wrote it.

    Tokenised the way the agent loop builds a response, piece by piece: with
    ``tool_output`` the result blocks (:func:`anchor_rl.tools.parsing.split_tool_output`)
    are encoded on their own and flagged ``False`` (tool output carries no loss); without
    it the whole text is one policy piece. Used to train on, score or inject reference and
    teacher traces.
    """
    pieces = split_tool_output(text) if tool_output else [(text, True)]
    ids: list[int] = []
    policy: list[bool] = []
    for piece, by_policy in pieces:
        piece_ids = tokenizer.encode(piece, add_special_tokens=False)
        ids += piece_ids
        policy += [by_policy] * len(piece_ids)
    return ids, policy
