"""An engine frontend over the reference's own tokens, to test the judge against (§4.5-§4.10).

Real serving stacks put a frontend over a token engine: the engine selects tokens, the frontend
turns them into text, matches stop strings, decides the finish reason, counts usage and streams.
This one serves /v1/models and /v1/completions on a forced checkpoint: the reference loop
(runtime.engine.Engine on the checkpoint's HFModel) selects the tokens under the request's
sampling fields, guards and token-id stops; the frontend does the rest itself, correctly, unless a
switch of BUGS plants one realistic bug. With no switch it answers as decodespec serve does.

    app = frontend_app(TokenEngine(checkpoint), bugs={"prompt_count"})
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import attrs

from decodespec.runtime.openai_schema import ApiError, parse_completion, token_text
from decodespec.runtime.tokenizers import own_bytes

# switch -> the frontend bug it plants (each one a judge blind spot of its own)
BUGS: Mapping[str, str] = {
    "prompt_count": "usage.prompt_tokens counts one token more than the prompt holds",
    "no_hold_back": "the stream sends every whole character at once; a stop that then completes cuts what is "
                    "still unsent, and the start of it already sent stays",
    "repeat_delta": "the stream sends its second text delta twice",
    "late_delta": "the stream sends its last text delta after the finish chunk",
    "logit_bias_ignored": "logit_bias is accepted and never given to the engine",
    "eos_text": "a run the EOS ends gets the EOS token's text at its end, in both answers",
    "no_usage_chunk": "stream_options.include_usage is accepted and no usage chunk is sent",
    "n_ignored": "n is accepted and one choice is answered, whatever n asks",
}


@attrs.frozen
class Answer:
    """One choice, as the frontend made it: the text (bytes), its stream deltas with the tokens
    selected when each was released (`steps`), the finish reason, the tokens it counts (selected up
    to the end) and the tokens it reports."""

    text: bytes
    deltas: tuple[bytes, ...]
    steps: tuple[int, ...]
    finish_reason: str
    completion_tokens: int
    tokens: tuple[int, ...]
    error: str | None = None  # the output is no UTF-8 text: the run fails after `text` (D12)


def _valid(data: bytes) -> tuple[bytes, bool]:
    """The longest prefix of `data` that is whole UTF-8 text, and whether that is all of it (an
    unfinished character at the end waits for its next bytes; an invalid byte never goes out)."""
    try:
        data.decode("utf-8")
        return data, True
    except UnicodeDecodeError as exc:
        return data[:exc.start], False


def _held(text: bytes, stops: Sequence[bytes]) -> int:
    """How many bytes at the end of `text` could still begin a stop (§4.6 hold-back)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def _first_stop(text: bytes, stops: Sequence[bytes]) -> tuple[int, bytes] | None:
    """The stop that ends first in `text` (D3: earliest end, then longest, then as configured)."""
    hits = [(text.find(s) + len(s), -len(s), i, s) for i, s in enumerate(stops) if s and s in text]
    if not hits:
        return None
    end, _, _, s = min(hits)
    return end - len(s), s


class TokenEngine:
    """The engine under every frontend of one checkpoint: the reference Engine on its HFModel, one
    run at a time. A greedy run on a forced checkpoint is the same every time, so each distinct
    request runs once (`runs` counts them)."""

    def __init__(self, checkpoint: Any) -> None:
        from decodespec.runtime.engine import Engine
        from decodespec.runtime.hfmodel import HFModel
        from decodespec.runtime.tokenizers import HFTokenizer

        self.name = checkpoint.group
        self.tok = HFTokenizer(checkpoint.folder)
        self.model = HFModel(checkpoint.folder)
        self.engine = Engine(self.model, self.tok)
        self.lock = threading.Lock()
        self.known: dict[str, tuple[tuple[int, ...], str]] = {}
        self.runs = 0

    def tokens(self, request: Any) -> tuple[tuple[int, ...], str]:
        """The tokens `request` selects and how its run ended (a FinishReason value). Its stream is
        not read, so it buffers every event."""
        req = attrs.evolve(request, request_id=f"fe-{uuid.uuid4().hex}", policy="buffer", max_buffer_events=1 << 20)
        key = repr(attrs.evolve(req, request_id="fe"))
        with self.lock:
            if key not in self.known:
                run = self.engine.submit(req)
                self.engine.run_until_idle()
                res = run.result()
                self.known[key] = (tuple(res.tokens), res.finish_reason.value)
                self.runs += 1
            return self.known[key]


class Frontend:
    """A frontend over `engine` (a TokenEngine) with the `bugs` of BUGS planted: `answer(parsed)`
    answers a parsed request (openai_schema.parse_completion)."""

    def __init__(self, engine: TokenEngine, bugs: Collection[str] = ()) -> None:
        if unknown := sorted(set(bugs) - set(BUGS)):
            raise ValueError(f"no such frontend bug: {', '.join(unknown)}; known: {', '.join(BUGS)}")
        self.bugs = frozenset(bugs)
        self.engine, self.name, self.tok = engine, engine.name, engine.tok
        self.eos_ids = frozenset(getattr(self.tok, "eos_ids", ()) or {self.tok.eos_id})

    def tokens(self, parsed: Any) -> tuple[tuple[int, ...], str]:
        """The engine's side: its tokens for the request without its stop strings and output fields
        (the frontend's to apply)."""
        return self.engine.tokens(attrs.evolve(
            parsed.request, stop=(), include_stop_str_in_output=False, echo=False, logprobs=None,
            **({"logit_bias": {}} if "logit_bias_ignored" in self.bugs else {})))

    def answer(self, parsed: Any) -> Answer:
        """Detokenize, match the stop strings, end and count the run, and cut its stream (§4.5-§4.7,
        §4.10), as decodespec serve does, but for the planted bugs. With echo the prompt's text
        opens the output (D33); the stops are matched in the output alone."""
        req = parsed.request
        tokens, ended = self.tokens(parsed)
        prompt = list(req.prompt) if not isinstance(req.prompt, str) else self.tok.encode(req.prompt)
        skip = req.skip_special_tokens
        head = self.tok.decode_bytes(prompt, skip_special=skip)
        echo = head if req.echo else b""
        text_tokens = tokens[:-1] if ended in ("eos", "stop_sequence") and tokens else tokens
        stops = [s.encode() for s in req.stop]
        sent, deltas, steps = b"", [], []
        out, reason, count = b"", "length" if ended in ("max_output_tokens", "context_limit") else "stop", len(tokens)
        for i in range(len(text_tokens)):
            text = self.tok.decode_bytes(prompt + list(text_tokens[:i + 1]), skip_special=skip)[len(head):]
            if hit := _first_stop(text, stops):
                at, stop = hit
                out, reason, count = text[:at + (len(stop) if req.include_stop_str_in_output else 0)], "stop", i + 1
                break
            safe = _valid(echo + text)[0]
            if "no_hold_back" not in self.bugs:
                safe = safe[:len(safe) - _held(safe, stops)]
            if len(safe) > len(sent):
                deltas.append(safe[len(sent):])
                steps.append(i + 1)
                sent = safe
        else:
            out = self.tok.decode_bytes(prompt + list(text_tokens), skip_special=skip)[len(head):]
            if "eos_text" in self.bugs and ended == "eos":
                out += self.tok.decode_bytes([tokens[-1]], skip_special=False)
        shown, whole = _valid(echo + out)
        if shown.startswith(sent) and len(shown) > len(sent):
            deltas.append(shown[len(sent):])
            steps.append(count)
        if "repeat_delta" in self.bugs and len(deltas) > 1:
            deltas.insert(2, deltas[1])
            steps.insert(2, steps[1])
        return Answer(shown, tuple(deltas), tuple(steps), reason, count, tokens[:count],
                      error=None if whole else "decoding_error: the output is not UTF-8 text (D12)")

    def usage(self, parsed: Any, answers: Sequence[Answer]) -> dict[str, int]:
        req = parsed.request
        prompt = len(req.prompt) if not isinstance(req.prompt, str) else len(self.tok.encode(req.prompt))
        prompt += "prompt_count" in self.bugs
        done = sum(a.completion_tokens for a in answers)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def reports(self, parsed: Any, tokens: Sequence[int]) -> dict[str, Any]:
        """The per-token reports asked for (logprobs, token ids) of `tokens`; none when not asked."""
        out: dict[str, Any] = {}
        if parsed.logprobs is not None:
            out["logprobs"] = {"tokens": [token_text(self.tok, t, None if t in self.eos_ids else own_bytes(self.tok, t))
                                          for t in tokens],
                               "token_logprobs": [0.0] * len(tokens), "top_logprobs": None, "text_offset": None}
        if parsed.token_ids:
            out["token_ids"] = list(tokens)
        return out

    def choice(self, parsed: Any, a: Answer, index: int) -> dict[str, Any]:
        """A non-streamed choice: its text, finish reason, and the per-token reports asked for."""
        return {"index": index, "text": a.text.decode("utf-8", "replace"), "finish_reason": a.finish_reason,
                "logprobs": None, **self.reports(parsed, a.tokens)}

    def delta(self, parsed: Any, index: int, data: bytes, tokens: Sequence[int], step: int) -> dict[str, Any]:
        """A delta chunk's choice: its text and, where the stream asks for per-token reports, those of
        `tokens` and how many tokens were selected when it was released."""
        out = {"index": index, "text": data.decode("utf-8", "replace"), "finish_reason": None}
        if parsed.reports_tokens:
            out.update(self.reports(parsed, tokens), decodespec={"selected": step})
        return out

    def events(self, parsed: Any, answers: Sequence[Answer], cid: str) -> Iterator[str]:
        """The SSE body: each choice's deltas, its finish chunk, the usage chunk when asked, [DONE].
        A stream that asks for per-token reports gets, with each delta, the tokens selected since the
        last one and how many were selected when it was released (`decodespec.selected`, as
        decodespec serve says it, D59); the finish chunk reports the rest."""
        def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
            return "data: " + json.dumps({"id": cid, "object": "text_completion", "model": self.name,
                                          "choices": choices, **more}) + "\n\n"

        for i, a in enumerate(answers):
            sent = list(zip(a.deltas, a.steps))
            late = sent.pop() if "late_delta" in self.bugs and sent and a.error is None else None
            shown = 0  # the tokens reported so far
            for d, step in sent:
                yield chunk([self.delta(parsed, i, d, a.tokens[shown:step], step)])
                shown = max(shown, step)
            if a.error is not None:
                yield f"data: {json.dumps(_failed(a).body())}\n\n"
                return
            yield chunk([{"index": i, "text": "", "finish_reason": a.finish_reason,
                          **(self.reports(parsed, a.tokens[shown:]) if parsed.reports_tokens else {})}])
            if late is not None:
                yield chunk([self.delta(parsed, i, late[0], (), late[1])])
        if parsed.include_usage and "no_usage_chunk" not in self.bugs:
            yield chunk([], usage=self.usage(parsed, answers))
        yield "data: [DONE]\n\n"


def _failed(a: Answer) -> ApiError:
    return ApiError(500, f"the run failed: {a.error}", code="decoding_error", type="server_error")


def frontend_app(engine: TokenEngine, bugs: Collection[str] = ()) -> Any:
    """The Starlette app of a Frontend over `engine` with the `bugs` of BUGS planted."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    fe = Frontend(engine, bugs)

    async def completions(request: Request) -> Any:
        try:
            parsed = parse_completion(await request.body(), chat=False, model_name=fe.name,
                                      context_limit=fe.engine.model.context_limit, vocab_size=fe.tok.vocab_size, tokenizer=fe.tok)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        one = await run_in_threadpool(fe.answer, parsed)
        answers = [one] * (1 if "n_ignored" in fe.bugs else parsed.n)  # greedy choices of one prompt are equal (D34)
        cid = f"cmpl-{uuid.uuid4().hex}"
        if one.error is not None and not parsed.stream:
            return JSONResponse(_failed(one).body(), status_code=_failed(one).status)
        if parsed.stream:
            return StreamingResponse(fe.events(parsed, answers, cid), media_type="text/event-stream")
        return JSONResponse({"id": cid, "object": "text_completion", "model": fe.name,
                             "choices": [fe.choice(parsed, a, i) for i, a in enumerate(answers)],
                             "usage": fe.usage(parsed, answers)})

    async def models(request: Request) -> Any:
        return JSONResponse({"object": "list", "data": [{"id": fe.name, "object": "model"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models)])
