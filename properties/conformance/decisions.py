"""The project's decisions a finding can rest on instead of a rule of chapter 4 (spec/DECISIONS.md).

Chapter 4 leaves some behaviours open (which stop wins a tie, what min_tokens means, how n choices
are counted, ...); spec/DECISIONS.md fixes each one for the reference, and common engines choose
otherwise. A finding that rests on such a choice is reported as what it is: the decision's number,
what the project chose and what engines do instead, one line each. Data only: the symptom table
(symptoms.SYMPTOMS) names a decision a symptom always rests on; a case file names the decisions it
rests on (`"decisions": ["D31"]`), and `covers` says which of its findings a different choice on
that decision shows (the others stay the chapter's).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs


@attrs.frozen
class Decision:
    """One decision of spec/DECISIONS.md as a basis: `ours` what the project chose, `instead` what
    common engines do, `covers` the symptoms another choice shows in a case that rests on it."""

    title: str
    ours: str
    instead: str
    covers: frozenset[str] = frozenset()


DECISIONS: Mapping[str, Decision] = {
    "D3": Decision(
        "several stop strings matching",
        "stops match the output only; the match that ends earliest wins, then the longest, then the first configured",
        "vLLM and llama-cpp-python cut at the first configured stop that matches; transformers also matches across "
        "the prompt",
        frozenset({"stop_sent", "text_after_stop", "bytes_lost", "count_low", "stop_without_hit"})),
    "D4": Decision(
        "finish-reason precedence on one token",
        "EOS > content policy > stop > max_tokens: a stop or EOS on the last allowed token reports 'stop'",
        "llama.cpp and vLLM report 'length' when a stop completes inside the last allowed token; transformers whenever "
        "that token is reached"),
    "D7": Decision(
        "usage",
        "completion_tokens counts every selected token, the one that completes a stop included",
        "some engines leave the token that completed a stop (or the EOS) out of completion_tokens",
        frozenset({"count_low", "usage_mismatch"})),
    "D18": Decision(
        "max_tokens 0",
        "a request with max_tokens 0 selects no token: a 4xx refusal or an empty 'length' answer",
        "llama.cpp's server answers one token; llama-cpp-python runs to EOS",
        frozenset({"past_limit", "text_after_stop", "bytes_added"})),
    "D31": Decision(
        "min_tokens and ignore_eos",
        "min_tokens and ignore_eos turn the EOS check off only; a stop string still ends the run at any token",
        "vLLM searches stop strings only after min_tokens; llama.cpp has no min_tokens and bans EOS under ignore_eos",
        frozenset({"stop_sent", "text_after_stop", "token_after_stop", "stop_without_hit", "bytes_lost", "count_low",
                   "special_sent", "early_length", "after_eos"})),
    "D33": Decision(
        "what the output holds: kept stops, special tokens, echo",
        "include_stop_str_in_output keeps a stop string, never a stop token id's text; echo sends decode(prompt) "
        "before the output, so echo plus output is decode(prompt + output), one valid text",
        "vLLM keeps a stop id's text under include_stop_str_in_output and echoes the prompt's text as a string (a "
        "split character as U+FFFD); llama.cpp's server has no echo",
        frozenset({"bytes_inserted", "bytes_replaced", "bytes_lost", "bytes_added", "special_sent"})),
    "D34": Decision(
        "n choices",
        "n choices are n runs, each with its own finish; usage counts every choice's tokens",
        "llama.cpp's server counts one choice's tokens in usage; some servers return one choice",
        frozenset({"count_low", "usage_mismatch"})),
    "D42": Decision(
        "SSE ids and Last-Event-ID resumption",
        "every stream event carries an SSE id, and a stream can be resumed from Last-Event-ID",
        "the OpenAI API defines no resumption: vLLM, llama.cpp and most servers send no SSE ids"),
    "D45": Decision(
        "the chat answer's channels",
        "reasoning_content is exactly the text between <think> and </think>",
        "vLLM's reasoning parsers treat the text before </think> as reasoning without a <think>"),
    "D47": Decision(
        "tool calls whole at their close",
        "a tool call is reported whole once </tool_call> closes it; finish_reason tool_calls when the model ended "
        "the turn holding calls",
        "vLLM streams argument fragments as the JSON grows and says tool_calls whenever its parser found a call"),
    "D59": Decision(
        "token ids and logprobs go with the text they spell",
        "each chunk's per-token reports are the selected tokens its text comes from, each once, in order",
        "vLLM reports each step's tokens in that step's chunk (the text lags by the stop buffer); llama.cpp reports "
        "per-token pieces of its own"),
}


def decision_line(number: str) -> str:
    """'D31 (min_tokens and ignore_eos): ours ...; engines: ...', one line for a finding's basis."""
    d = DECISIONS[number]
    return f"{number} ({d.title}): {d.ours}; instead: {d.instead}"
