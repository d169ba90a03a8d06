"""`openai`: any OpenAI-compatible server, black box, over HTTP (§4.5-§4.10).

Greedy runs (temperature 0) make the server deterministic: an unconstrained run shows its text
(and, with logprobs, its tokens); each recipe then chooses stop strings *from that text* (across a
token boundary, a multi-byte character, two overlapping ones, one ending on the last allowed token)
and checks what the spec requires of the answer. SSE is parsed by hand with httpx, so a framing
error is seen rather than smoothed over by a client library. A recipe that cannot build its probe
from this server's output (no multi-byte character, no natural EOS) is a SKIP with the reason.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import attrs
import httpx

from ..cases import Case
from .base import Finding, Outcome, missing_capabilities

ALLOWED_REASONS = frozenset({"stop", "length", "content_filter", "tool_calls", "function_call"})
_GAUGE = re.compile(r"^([A-Za-z_:][\w:]*(?:running|active|in_flight|inflight)[\w:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")


@attrs.define
class Answer:
    """One non-streamed response."""

    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    tokens: list[str] | None


@attrs.define
class Streamed:
    """One streamed response, as parsed from its SSE lines."""

    deltas: list[str] = attrs.field(factory=list)
    finish_reasons: list[str] = attrs.field(factory=list)
    content_after_finish: list[str] = attrs.field(factory=list)
    done: bool = False
    data_after_done: int = 0
    usage: dict[str, Any] | None = None
    malformed: list[str] = attrs.field(factory=list)

    @property
    def text(self) -> str:
        return "".join(self.deltas)


class OpenAIAdapter:
    """Black-box recipes against `url` (e.g. http://127.0.0.1:8000)."""

    capabilities = frozenset({"http"})

    def __init__(self, url: str, *, model: str | None = None, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.name = f"openai[{self.url}]"
        self._model = model
        self.client = httpx.Client(base_url=self.url, timeout=timeout)

    def unsupported(self, case: Case) -> str | None:
        missing = missing_capabilities(self, case)
        return f"{missing} (a white-box case; a black-box server cannot force tokens)" if missing else None

    @property
    def model(self) -> str:
        if self._model is None:
            data = self.client.get("/v1/models").raise_for_status().json().get("data") or []
            if not data:
                raise RuntimeError(f"{self.url}/v1/models lists no model; pass --model")
            self._model = data[0]["id"]
        return self._model

    # ---- requests --------------------------------------------------------------------------

    def body(self, case: Case, *, stream: bool, **over: Any) -> dict[str, Any]:
        inp = case.inputs
        chat = inp.get("endpoint") == "chat"
        b: dict[str, Any] = {"model": self.model, "max_tokens": inp.get("max_tokens", 24), "temperature": 0,
                             "stream": stream}
        if chat:
            b["messages"] = [{"role": "user", "content": inp["prompt"]}]
            b["logprobs"] = True
        else:
            b["prompt"] = inp["prompt"]
            b["logprobs"] = 1
        b.update(over)
        return {k: v for k, v in b.items() if v is not None}

    def path(self, case: Case) -> str:
        return "/v1/chat/completions" if case.inputs.get("endpoint") == "chat" else "/v1/completions"

    def complete(self, case: Case, **over: Any) -> Answer:
        r = self.client.post(self.path(case), json=self.body(case, stream=False, **over))
        r.raise_for_status()
        choice = r.json()["choices"][0]
        chat = "message" in choice
        text = (choice["message"].get("content") or "") if chat else choice.get("text", "")
        return Answer(text, choice.get("finish_reason"), r.json().get("usage"), _tokens(choice.get("logprobs"), chat, text))

    def stream(self, case: Case, *, stop_after: int | None = None, **over: Any) -> Streamed:
        """POST with stream=true and parse the SSE by hand; `stop_after` n deltas drops the connection."""
        out = Streamed()
        with self.client.stream("POST", self.path(case), json=self.body(case, stream=True, **over)) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if out.done:
                    out.data_after_done += 1
                    continue
                if payload == "[DONE]":
                    out.done = True
                    continue
                try:
                    chunk = json.loads(payload)
                except json.JSONDecodeError:
                    out.malformed.append(payload[:80])
                    continue
                if chunk.get("usage"):
                    out.usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                    if delta:
                        (out.content_after_finish if out.finish_reasons else out.deltas).append(delta)
                    if choice.get("finish_reason"):
                        out.finish_reasons.append(choice["finish_reason"])
                if stop_after is not None and len(out.deltas) >= stop_after:
                    break  # leaving the block closes the connection mid-stream
        return out

    def run(self, case: Case) -> Outcome:
        recipe = RECIPES.get(case.recipe or "")
        if recipe is None:
            return Outcome(skip=f"this adapter has no recipe {case.recipe!r}")
        return recipe(self, case)


def _tokens(logprobs: Any, chat: bool, text: str) -> list[str] | None:
    """The token strings a response reveals through logprobs, when they spell its text."""
    if not logprobs:
        return None
    toks = [c.get("token", "") for c in logprobs.get("content") or []] if chat else list(logprobs.get("tokens") or [])
    return toks if toks and "".join(toks) == text else None


# ---- recipes ------------------------------------------------------------------------------------


def _outcome(ans: Answer | None, st: Streamed | None, findings: list[Finding], notes: tuple[str, ...] = ()) -> Outcome:
    return Outcome(output=ans.text.encode() if ans else None, chunks=tuple(d.encode() for d in st.deltas) if st else None,
                   finish_reason=ans.finish_reason if ans else None, findings=tuple(findings), notes=notes)


def _check_stop(a: OpenAIAdapter, case: Case, stops: list[str], expected: str, **over: Any) -> tuple[Answer, Streamed, list[Finding]]:
    ans = a.complete(case, stop=stops, **over)
    st = a.stream(case, stop=stops, **over)
    found = []
    for label, text in (("non-streamed text", ans.text), ("stream", st.text)):
        for s in stops:
            if s in text:
                found.append(Finding("stop_bytes_never_emitted", f"the {label} contains the stop {s!r}: {text!r}"))
    for d in st.deltas:
        if any(s in d for s in stops):
            found.append(Finding("stop_bytes_never_emitted", f"a streamed delta carries a stop: {d!r}"))
    if ans.text != expected:
        found.append(Finding(case.invariant, f"with stop {stops!r} the text is {ans.text!r}, expected {expected!r}"))
    if st.text != ans.text:
        found.append(Finding("detok_concat_equals_batch", f"stream {st.text!r} differs from non-stream {ans.text!r}"))
    if ans.finish_reason != "stop":
        found.append(Finding(case.invariant, f"finish_reason {ans.finish_reason!r} after a stop hit, expected 'stop'"))
    return ans, st, found


def stream_agrees(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.5: the concatenated stream equals the non-streamed text (the judge compares them)."""
    return _outcome(a.complete(case), a.stream(case), [])


def stream_framing(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.7: one finish chunk, from the allowed set, nothing after it, then [DONE] and nothing more."""
    st = a.stream(case)
    f = []
    if len(st.finish_reasons) != 1:
        f.append(Finding("single_terminal_event", f"{len(st.finish_reasons)} chunks carry a finish_reason: {st.finish_reasons}"))
    bad = [r for r in st.finish_reasons if r not in ALLOWED_REASONS]
    if bad:
        f.append(Finding("finish_reason_matches_state", f"finish_reason {bad} is not one of {sorted(ALLOWED_REASONS)}"))
    if st.content_after_finish:
        f.append(Finding("no_delta_after_terminal", f"content after the finish chunk: {st.content_after_finish}"))
    if not st.done:
        f.append(Finding("single_terminal_event", "the stream did not end with data: [DONE]"))
    if st.data_after_done:
        f.append(Finding("no_delta_after_terminal", f"{st.data_after_done} data line(s) after [DONE]"))
    if st.malformed:
        f.append(Finding("refinement", f"data lines that are not JSON: {st.malformed}"))
    return _outcome(None, st, f)


def stop_cross_token(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.6: a stop across a token boundary of the unconstrained output."""
    base = a.complete(case)
    t = base.text
    notes: tuple[str, ...] = ()
    bounds = []
    if base.tokens:
        pos = 0
        for tok in base.tokens[:-1]:
            pos += len(tok)
            bounds.append(pos)
    else:
        bounds = list(range(2, len(t) - 2))
        notes = ("the server reveals no tokens (logprobs); the stop may not cross a token boundary",)
    bounds.sort(key=lambda b: abs(b - len(t) // 2))
    for b in bounds:
        stop = t[b - 2 : b + 2]
        if b >= 2 and b + 2 <= len(t) and stop.strip() and t.find(stop) == b - 2:
            ans, st, f = _check_stop(a, case, [stop], t[: b - 2])
            return _outcome(ans, st, f, notes + (f"unconstrained text {t!r}; stop {stop!r} across offset {b}",))
    return Outcome(skip=f"no stop string across a token boundary could be chosen from {t!r}")


def stop_multi_byte(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.6: a stop that is a multi-byte character of the output."""
    t = a.complete(case).text
    p = next((i for i, ch in enumerate(t) if i > 0 and len(ch.encode()) > 1), None)
    if p is None:
        return Outcome(skip=f"the unconstrained output has no multi-byte character after its first: {t!r}")
    ans, st, f = _check_stop(a, case, [t[p]], t[: t.find(t[p])])
    return _outcome(ans, st, f, (f"unconstrained text {t!r}; stop {t[p]!r}",))


def stop_overlap(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.6 (D3): overlapping stops, the later-ending one listed first; the earliest end wins."""
    t = a.complete(case).text
    for i in sorted(range(len(t) - 5), key=lambda i: abs(i - len(t) // 3)):
        s1, s2 = t[i : i + 4], t[i + 2 : i + 6]
        if s1.strip() and s2.strip() and t.find(s1) == i and t.find(s2) == i + 2:
            ans, st, f = _check_stop(a, case, [s2, s1], t[:i])
            return _outcome(ans, st, f, (f"unconstrained text {t!r}; stops {[s2, s1]!r}",))
    return Outcome(skip=f"no two overlapping stops could be chosen from {t!r}")


def stop_last_token(a: OpenAIAdapter, case: Case) -> Outcome:
    """D4: a stop completed by the last allowed token reports 'stop', not 'length'."""
    base = a.complete(case)
    if not base.tokens:
        return Outcome(skip="the server reveals no tokens (logprobs), so the last allowed token is unknown")
    for k in range(len(base.tokens) // 2, len(base.tokens)):
        prefix = "".join(base.tokens[:k])
        stop = prefix[-2:]
        if len(prefix) >= 3 and stop.strip() and base.text.find(stop) == len(prefix) - 2:
            ans, st, f = _check_stop(a, case, [stop], prefix[:-2], max_tokens=k)
            return _outcome(ans, st, f, (f"stop {stop!r} ends token {k}; max_tokens {k}",))
    return Outcome(skip=f"no stop ending exactly on a token could be chosen from {base.text!r}")


def max_tokens_exact(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.3: max_tokens k gives exactly k tokens, reason 'length', a prefix of the greedy text."""
    base = a.complete(case)
    n = (base.usage or {}).get("completion_tokens") or len(base.tokens or []) or case.inputs.get("max_tokens", 24)
    k = max(1, min(5, n - 1))
    ans = a.complete(case, max_tokens=k)
    f = []
    if ans.finish_reason != "length":
        f.append(Finding(case.invariant, f"max_tokens {k} below the natural length {n}: finish_reason {ans.finish_reason!r}, expected 'length'"))
    got = (ans.usage or {}).get("completion_tokens")
    if got is not None and got != k:
        f.append(Finding(case.invariant, f"max_tokens {k}: usage.completion_tokens is {got}"))
    if not base.text.startswith(ans.text):
        f.append(Finding("detok_concat_equals_batch", f"the {k}-token text {ans.text!r} is not a prefix of the greedy text {base.text!r}"))
    return _outcome(ans, None, f, (f"k={k}, natural length {n}",))


def eos_last_token(a: OpenAIAdapter, case: Case) -> Outcome:
    """D4: EOS as the last allowed token reports 'stop', not 'length'."""
    base = a.complete(case, max_tokens=64)
    n = (base.usage or {}).get("completion_tokens")
    if base.finish_reason != "stop" or not n:
        return Outcome(skip=f"the model did not end by itself within 64 tokens (finish_reason {base.finish_reason!r})")
    ans = a.complete(case, max_tokens=n)
    f = [] if ans.finish_reason == "stop" else [
        Finding(case.invariant, f"EOS on token {n} = max_tokens: finish_reason {ans.finish_reason!r}, expected 'stop'")]
    return _outcome(ans, None, f)


def usage(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.10: usage present and consistent, streamed usage equal to the non-streamed one."""
    ans = a.complete(case)
    st = a.stream(case, stream_options={"include_usage": True})
    f = []
    u = ans.usage or {}
    if not {"prompt_tokens", "completion_tokens"} <= set(u):
        f.append(Finding("usage_consistent", f"usage lacks prompt/completion counts: {u}"))
    elif u.get("total_tokens") is not None and u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]:
        f.append(Finding("usage_consistent", f"total_tokens {u['total_tokens']} != prompt + completion in {u}"))
    if st.usage is None:
        f.append(Finding("usage_consistent", "stream_options.include_usage gave no usage chunk"))
    elif {k: st.usage.get(k) for k in ("prompt_tokens", "completion_tokens")} != {k: u.get(k) for k in ("prompt_tokens", "completion_tokens")}:
        f.append(Finding("usage_consistent", f"streamed usage {st.usage} differs from non-streamed {u}"))
    return _outcome(ans, st, f)


def _gauges(a: OpenAIAdapter) -> dict[str, float] | None:
    r = a.client.get("/metrics")
    if r.status_code != 200:
        return None
    return {m.group(1) + (m.group(2) or ""): float(m.group(3)) for line in r.text.splitlines() if (m := _GAUGE.match(line))}


def disconnect(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.7 rule 5, §4.9: a dropped stream leaves the server serving; metrics show the request freed."""
    before = _gauges(a)
    st = a.stream(case, stop_after=2)
    f = []
    notes = [f"dropped after {len(st.deltas)} delta(s)"]
    try:
        after = a.complete(case, max_tokens=2)
        if after.finish_reason is None and not after.text:
            f.append(Finding(case.invariant, "after the disconnect the server answered without text or finish_reason"))
    except httpx.HTTPError as exc:
        f.append(Finding(case.invariant, f"after the disconnect the server no longer serves: {exc}"))
    if before is None or not before:
        notes.append("no running/active gauge on /metrics: freeing not checked")
    else:
        deadline = time.monotonic() + 10
        now = _gauges(a) or {}
        while time.monotonic() < deadline and any(now.get(k, 0) > v for k, v in before.items()):
            time.sleep(0.2)
            now = _gauges(a) or {}
        grown = {k: (before[k], now.get(k)) for k in before if now.get(k, 0) > before[k]}
        if grown:
            f.append(Finding("no_leak", f"10 s after the disconnect these gauges stay above their level before: {grown}"))
    return _outcome(None, None, f, tuple(notes))


def bad_input(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.1 (CREATED -> reject): malformed requests get a 4xx, and the server keeps serving."""
    f = []
    for over in ({"max_tokens": -1}, {"stop": 5}, {"temperature": "hot"}):
        r = a.client.post(a.path(case), json=a.body(case, stream=False, **over))
        if not 400 <= r.status_code < 500:
            f.append(Finding(case.invariant, f"{over} answered {r.status_code}, expected a 4xx"))
    try:
        a.complete(case, max_tokens=2)
    except httpx.HTTPError as exc:
        f.append(Finding(case.invariant, f"after bad requests the server no longer serves: {exc}"))
    return _outcome(None, None, f)


RECIPES: dict[str, Callable[[OpenAIAdapter, Case], Outcome]] = {
    f.__name__: f for f in (stream_agrees, stream_framing, stop_cross_token, stop_multi_byte, stop_overlap,
                            stop_last_token, max_tokens_exact, eos_last_token, usage, disconnect, bad_input)
}
