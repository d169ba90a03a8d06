"""The OpenAI adapter reads the tokens an answer reveals through its logprobs (D59): a `content`
entry whose `bytes` is null is a token with no bytes representation (the EOS, as decodespec serve
and OpenAI's API send it), not a reason to drop what the other entries say."""

from __future__ import annotations

from decodespec.properties.conformance.adapters.openai import logprob_tokens

_CAT = "小猫在花园里玩"


def _entry(token: str, data: bytes | None) -> dict:
    return {"token": token, "logprob": -0.1, "bytes": None if data is None else list(data), "top_logprobs": []}


def test_an_eos_entry_with_null_bytes_adds_a_token_with_no_text():
    content = [_entry(_CAT, _CAT.encode()), _entry("。", "。".encode()), _entry("<|endoftext|>", None)]
    assert logprob_tokens({"content": content}, _CAT + "。") == [_CAT, "。", ""]


def test_a_character_split_across_entries_goes_to_the_token_that_completes_it():
    data = "玩。".encode()
    content = [_entry("玩", data[:2]), _entry("。", data[2:]), _entry("<|endoftext|>", None)]
    assert logprob_tokens({"content": content}, "玩。") == ["", "玩。", ""]


def test_entries_without_a_bytes_field_are_read_by_their_token_strings():
    content = [{"token": "ab", "logprob": -0.1}, {"token": "c", "logprob": -0.2}]
    assert logprob_tokens({"content": content}, "abc") == ["ab", "c"]
    assert logprob_tokens({"content": content}, "abd") is None  # tokens that do not spell the text say nothing
