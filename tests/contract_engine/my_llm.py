"""my_llm: a small greedy engine over transformers' Llama, standing in for an in-house engine's
Python API (examples/my_engine.py adapts it to decodespec's adapter contract). It imports nothing
of decodespec: tests/test_contract.py checks that.

    llm = LLM("ckpts/byte_table", max_model_len=None)  # None: the config's max_position_embeddings
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=8, stop=["BCD"]))
    out.outputs[0].text, out.outputs[0].token_ids, out.outputs[0].finish_reason
    for d in llm.generate_stream(ids, params): d.index, d.text, d.tokens, d.selected, d.finish_reason
    ids = llm.render_chat(messages, tools=...)     # then generate(ids, params, channels=True)

Decoding is greedy over the model's logits (memoized by prefix, so a request repeated at another
max_tokens costs nothing), with the usual request fields: stop strings (held back while they may
still match, the earliest match cutting the text), stop token ids, min_tokens (masks EOS and the
stop ids), ignore_eos, logit_bias, echo, skip_special_tokens, include_stop_str_in_output, n; a run
ends with 'length' once prompt and output fill `max_model_len` positions. With
`channels`, `<think>` sections go to `reasoning` and `<tool_call>{json}</tool_call>` to tool calls
(a complete call ends the run with 'tool_calls'; a cut one stays content, tags and all).

`BUGS` names behaviours to break, one per kind of finding (tests/test_contract.py plants them):
"departure" (the runner-up token at the second step), "sweep" (a run cut at max_tokens 1 says
'stop'), "channels" (think tags left in the content), "n" (usage counts one choice of several),
"alignment" (a chunk's token ids sent with the next chunk), "context" (the run goes on past
`max_model_len`), "holdback" (text that may begin a stop string sent before it is ruled out).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer, LlamaForCausalLM

BUGS: set[str] = set()
THINK = ("<think>", "</think>")
CALL = ("<tool_call>", "</tool_call>")


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    n: int = 1
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: Mapping[Any, float] | None = None
    echo: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclasses.dataclass
class Delta:
    """One streamed piece of output `index`: text (content), reasoning, whole tool calls (index,
    name, arguments), the tokens whose text it carries, the ids of the tokens selected since the
    last piece went out (its text held for a stop included)."""

    index: int
    text: str = ""
    reasoning: str = ""
    tool_calls: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    tokens: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (id, logprob)
    finish_reason: str | None = None
    selected: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    tokens: list[tuple[int, float]]  # (id, logprob)
    finish_reason: str | None
    reasoning: str | None = None
    tool_calls: list[tuple[str, str]] | None = None  # (name, arguments as JSON text)


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def completion_tokens(self) -> int:
        """The tokens every output selected ("n": the first output's alone)."""
        return sum(len(o.tokens) for o in (self.outputs[:1] if "n" in BUGS else self.outputs))


class Channels:
    """Text split into content, reasoning and tool calls as it streams: a tag's first characters are
    held until they are known to be one."""

    def __init__(self, tools: bool) -> None:
        self.tools = tools
        self.mode = "content"
        self.held = ""
        self.call = ""
        self.calls = 0
        self.closed = False  # a call was completed: the run ends

    def _tags(self) -> dict[str, str]:
        if self.mode == "reasoning":
            return {THINK[1]: "content"}
        if self.mode == "call":
            return {CALL[1]: "content"}
        opening = {THINK[0]: "reasoning"} if "channels" not in BUGS else {}
        return {**opening, **({CALL[0]: "call"} if self.tools else {})}

    def push(self, text: str, d: Delta, final: bool = False) -> None:
        self.held += text
        while True:
            tags = self._tags()
            found = [(self.held.find(t), t) for t in tags if t in self.held]
            if not found:
                break
            at, tag = min(found)
            self._put(self.held[:at], d)
            self.held = self.held[at + len(tag):]
            if self.mode == "call":
                self._close_call(d)
            self.mode = tags[tag]
        keep = 0 if final else max((k for t in self._tags() for k in range(1, len(t))
                                    if self.held.endswith(t[:k])), default=0)
        self._put(self.held[:len(self.held) - keep], d)
        self.held = self.held[len(self.held) - keep:]
        if final and self.mode == "call":  # a call the run cut: content, its tag too
            d.text += CALL[0] + self.call
            self.call = ""

    def _put(self, text: str, d: Delta) -> None:
        if self.mode == "reasoning":
            d.reasoning += text
        elif self.mode == "call":
            self.call += text
        else:
            d.text += text

    def _close_call(self, d: Delta) -> None:
        call = json.loads(self.call)
        d.tool_calls.append((self.calls, call["name"], json.dumps(call["arguments"])))
        self.calls += 1
        self.call = ""
        self.closed = True


class LLM:
    """A Llama checkpoint folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)."""

    def __init__(self, folder: str | Path, max_model_len: int | None = None) -> None:
        self.folder = Path(folder)
        self.model = LlamaForCausalLM.from_pretrained(self.folder, torch_dtype=torch.float32).eval()
        self.max_model_len = max_model_len or self.model.config.max_position_embeddings
        self.tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        config = json.loads((self.folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        self.eos_id = self.tokenizer.token_to_id(config["eos_token"])
        self.chat_template = config.get("chat_template")
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]:
        """The prompt ids of `messages` by the checkpoint's chat template, with the generation prompt."""
        if self.chat_template is None:
            raise ValueError(f"{self.folder} has no chat template")
        tok = AutoTokenizer.from_pretrained(self.folder)
        out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                      **template_kwargs)
        return list(out["input_ids"] if not isinstance(out, list) else out)

    def logits(self, ids: tuple[int, ...]) -> torch.Tensor:
        if ids not in self._logits:
            with torch.no_grad():
                self._logits[ids] = self.model(torch.tensor([ids])).logits[0, -1].float()
        return self._logits[ids]

    def text(self, ids: Sequence[int], skip_special: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def generate(self, prompt: Sequence[int], params: SamplingParams, *, channels: bool = False,
                 tools: bool = False) -> RequestOutput:
        """Every output whole: the streamed pieces of each, joined."""
        outs = {i: CompletionOutput(i, "", [], None, "" if channels else None, [] if channels else None)
                for i in range(params.n)}
        for d in self.generate_stream(prompt, params, channels=channels, tools=tools):
            o = outs[d.index]
            o.text += d.text
            o.tokens += d.tokens
            o.finish_reason = d.finish_reason or o.finish_reason
            if o.reasoning is not None and o.tool_calls is not None:
                o.reasoning += d.reasoning
                o.tool_calls += [(name, args) for _, name, args in d.tool_calls]
        return RequestOutput(list(prompt), list(outs.values()))

    def generate_stream(self, prompt: Sequence[int], params: SamplingParams, *, channels: bool = False,
                        tools: bool = False) -> Iterator[Delta]:
        """The outputs' pieces, the n outputs taking turns."""
        runs = [self._run(list(prompt), params, i, Channels(tools) if channels else None) for i in range(params.n)]
        while runs:
            for run in list(runs):
                piece = next(run, None)
                if piece is None:
                    runs.remove(run)
                else:
                    yield piece

    def _run(self, prompt: list[int], p: SamplingParams, index: int, split: Channels | None) -> Iterator[Delta]:
        bias = {int(k): float(v) for k, v in (p.logit_bias or {}).items()}
        ends = {self.eos_id, *p.stop_token_ids}
        out: list[int] = []
        head = self.text(prompt, p.skip_special_tokens).rstrip("\ufffd") if p.echo else ""

        def decoded(ids: list[int]) -> str:
            return self.text(prompt + ids if p.echo else ids, p.skip_special_tokens)

        sent = 0  # characters of the text released
        pending = Delta(index)
        late: list[tuple[int, float]] = []  # "alignment": the tokens owed to the next piece
        text, finish = None, "length"
        room = p.max_tokens if "context" in BUGS else min(p.max_tokens, self.max_model_len - len(prompt))
        for step in range(room):
            logits = self.logits(tuple(prompt + out)).clone()
            for tid, b in bias.items():
                logits[tid] += b
            if len(out) < p.min_tokens:
                logits[list(ends)] = float("-inf")
            ranked = torch.argsort(logits, descending=True)
            tid = int(ranked[1] if "departure" in BUGS and step == 1 else ranked[0])
            out.append(tid)
            pending.tokens.append((tid, float(torch.log_softmax(logits, -1)[tid])))
            pending.selected.append(tid)
            if tid in ends and not (tid == self.eos_id and p.ignore_eos):
                finish = "stop"
                break
            full = decoded(out)
            whole = full.rstrip("\ufffd")  # the text up to a character not yet whole
            hit = min(((whole.find(s, len(head)), s) for s in p.stop if s in whole[len(head):]), default=None)
            if hit is not None:
                text, finish = whole[:hit[0] + (len(hit[1]) if p.include_stop_str_in_output else 0)], "stop"
                break
            if whole != full:
                continue
            keep = max((k for s in p.stop for k in range(1, len(s)) if full.endswith(s[:k]) and "holdback" not in BUGS),
                       default=0)
            if len(full) - keep > sent:
                yield self._release(pending, full[sent:len(full) - keep], split, late)
                sent = len(full) - keep
                pending = Delta(index)
                if split is not None and split.closed:
                    finish = "tool_calls"
                    break
        if text is None:  # the whole output but the token that ended the run, whatever bytes it still held
            text = decoded(out[:-1] if finish == "stop" else out)
        if "sweep" in BUGS and finish == "length" and p.max_tokens == 1:
            finish = "stop"
        pending.finish_reason = finish
        yield self._release(pending, text[sent:], split, late, final=True)

    def _release(self, d: Delta, text: str, split: Channels | None, late: list[tuple[int, float]],
                 final: bool = False) -> Delta:
        if split is None:
            d.text = text
        else:
            split.push(text, d, final=final)
        if "alignment" in BUGS:
            late[:], d.tokens = d.tokens, late + (d.tokens if final else [])
        return d
