"""The character-level tokenizer: single-token tags, round trips, chat template, prompts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anchor_rl.models.tokenizer import (
    CHARACTERS,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    build_tokenizer,
    encode_prompt,
)

TOK = build_tokenizer()


def test_vocabulary_layout_and_special_ids():
    assert len(TOK) == len(SPECIAL_TOKENS) + len(TAG_TOKENS) + len(CHARACTERS) == 111
    assert TOK.pad_token_id == 0 and TOK.unk_token_id == 1
    assert TOK.eos_token == TOK.bos_token == "<|end|>" and TOK.eos_token_id == 5


@pytest.mark.parametrize("token", [*SPECIAL_TOKENS, *TAG_TOKENS])
def test_special_and_tag_tokens_are_single_tokens(token):
    ids = TOK.encode(token, add_special_tokens=False)
    assert len(ids) == 1
    assert TOK.decode(ids) == token


def test_every_character_is_one_token():
    text = "".join(CHARACTERS)
    assert len(TOK.encode(text)) == len(CHARACTERS)


@given(st.lists(st.sampled_from([*CHARACTERS, *TAG_TOKENS]), max_size=60).map("".join))
def test_decode_encode_round_trip(text):
    assert TOK.decode(TOK.encode(text)) == text


def test_skip_special_tokens_keeps_tags_and_drops_chat_tokens():
    ids = TOK.encode("<|assistant|><answer> 4 </answer><|end|><pad>")
    assert TOK.decode(ids, skip_special_tokens=True) == "<answer> 4 </answer>"


def test_unknown_characters_become_unk():
    assert TOK.encode("a\u00e9b") == [
        TOK.convert_tokens_to_ids("a"),
        TOK.unk_token_id,
        TOK.convert_tokens_to_ids("b"),
    ]


def test_chat_prompt_drops_the_system_message():
    ids = encode_prompt(TOK, "2+3=?", "Answer inside <answer></answer>.")
    assert TOK.decode(ids) == "<|user|>2+3=?<|end|><|assistant|>"
    assert ids == encode_prompt(TOK, "2+3=?", None)


def test_plain_prompt_without_chat_template():
    plain = build_tokenizer()
    plain.chat_template = None
    assert plain.decode(encode_prompt(plain, "2+3=?", "Be brief.")) == "Be brief.\n\n2+3=?"
    assert plain.decode(encode_prompt(plain, "2+3=?", None)) == "2+3=?"
