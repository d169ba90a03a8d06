"""`openai`: any OpenAI-compatible server, black box, over HTTP (§4.5-§4.10).

Two kinds of case run here. On a forced checkpoint (checkpoints.py) every script case compiled
into it becomes a real request (http_script.py). The black-box recipes run greedy (temperature 0)
so the server is deterministic: an unconstrained run shows its text (on a forced checkpoint, the
recipe program's; its tokens from logprobs or, failing that, from the program); each recipe then
chooses stop strings *from that text* (across a token boundary, a multi-byte character, two
overlapping ones, one ending on the last allowed token) and checks what the spec requires of the
answer. SSE is parsed by hand with httpx, so a framing error or an in-band `{"error": ...}` is seen
rather than smoothed over by a client library. Connection errors are retried a bounded number of
times, then the case is an ERROR with the cause, never a FAIL. A recipe that cannot build its probe
from this server's output is a SKIP with the reason.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs
import httpx

from ..cases import Case, CaseError, CaseKind
from ..checkpoints import LONG, RECIPE, Checkpoint, digest, group_of, http_blocker, reference_result, served_context
from ..http_script import probe_prefix, run_script
from ..judgement import no_usage_chunk, usage_chunk_missing
from ..life import RECIPES as LIFE_RECIPES
from ..script_check import prompt_placed
from ..symptoms import Expected, compare_reason, compare_stream, compare_text, finding, merge
from ..wire import (
    ANSWER,
    Streamed,
    StreamOverrun,
    Watch,
    body_ended,
    byte_values,
    feed,
    shape_error,
    sse_lines,
    terminal_findings,
    token_count,
    trim_middle,
    whole_answer,
    wire_findings,
)
from ..without import WITHOUT, lacking
from .base import Finding, Outcome, RunRaised, context_unmet, missing_capabilities

# Where a server says the context length it runs with (§4.3, D10): a path and the keys to the number
# in its JSON answer, the first that answers wins. llama-server reports a slot's context after its own
# rounding up; vLLM, SGLang and decodespec serve report max_model_len with the model. A gateway that
# says none of its own is read through its pass-through of its worker's (/worker/...:
# scripts/peers/litellm.sh routes LiteLLM's so, as it does the worker's /metrics).
CONTEXT_SOURCES: tuple[tuple[str, tuple[str | int, ...]], ...] = tuple(
    (prefix + path, keys) for prefix in ("", "/worker") for path, keys in (
        ("/props", ("default_generation_settings", "n_ctx")),
        ("/props", ("n_ctx",)),
        ("/v1/models", ("data", 0, "max_model_len"))))


def _at(value: Any, key: str | int) -> Any:
    """value[key] where value is a JSON object (str key) or list (int key) that has it, else None."""
    if isinstance(key, int):
        return value[key] if isinstance(value, list) and len(value) > key else None
    return value.get(key) if isinstance(value, dict) else None


@attrs.define
class Answer:
    """One non-streamed response."""

    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    tokens: list[str] | None


class ServerError(RuntimeError):
    """The server could not be reached or answered garbage: an ERROR of the run, never an engine FAIL."""


class PromptAltered(Exception):
    """The server did not take the prompt ids as sent: the case cannot be observed there (SKIP)."""


def _trim(text: str, limit: int = 2000) -> str:
    """A message's excerpt of an answer (the exchange log keeps the answer whole: trim_middle)."""
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"


NO_CHECKPOINT = ("a script case runs over HTTP only on a forced checkpoint: serve one (`decodespec checkpoints build`) "
                 "and pass it with --checkpoint DIR")


class OpenAIAdapter:
    """Black-box recipes, and script cases on a forced checkpoint, against `url` (http://127.0.0.1:8000).

    With `checkpoint` (the forced checkpoint folder the server serves, see checkpoints.py), every
    script case compiled into it runs as a real request: its prompt ids (marker first), stop
    strings, single stop_token_ids and max_tokens, greedy, non-streamed and streamed; the answer
    is judged against the reference loop's answer on the same checkpoint (http_script.py). The
    recipes then run on the checkpoint's recipe program, whose script is varied text. `without`
    names what the server lacks (without.WITHOUT: a request field, a parser): cases needing it SKIP.
    """

    capabilities = frozenset({"http"})

    def __init__(self, url: str, *, model: str | None = None, checkpoint: Checkpoint | None = None,
                 without: frozenset[str] = frozenset(), timeout: float = 60.0, retries: int = 2,
                 launch: str | None = None, sweep: bool = True, context: int | None = None,
                 tight: bool = False) -> None:
        self.url = url.rstrip("/")
        self.name = f"openai[{self.url}]"
        self._model = model
        self.served = checkpoint  # the forced checkpoint the server serves (None: recipes only)
        if unknown := sorted(set(without) - set(WITHOUT)):
            raise ValueError(f"without: {', '.join(unknown)} is not something a server can lack here; known: "
                             f"{', '.join(WITHOUT)}")
        self.without = frozenset(without)
        self.retries = retries
        self.timeout = timeout  # a whole answer (wire.whole_answer), a stream's next event (wire.Watch)
        self.client = httpx.Client(base_url=self.url, timeout=timeout)
        self._reference: dict[str, Any] = {}
        self._chat_ok: str | None = None  # "" once the chat endpoint is known to keep the prompt as sent
        self._id_prompts: bool | None = None  # whether the server takes token-id prompts (probed once)
        self._case = threading.local()  # the exchanges of the case this thread runs (for its reproducer)
        self.prompt_note = ""
        self.launch = launch  # the command that started the server, for reproducers
        self.sweep = sweep  # script cases also run at every max_tokens of their script (http_script.sweep)
        self.context = context  # the context length the server was started with, when set on purpose
        self.tight = tight  # started with its concurrency limited and a small KV budget (life/recipes.py)
        self._about: dict[str, Any] | None = None
        self._prefix: Any = None  # script_check.Prefix, once probed
        self._running_context: tuple[int | None, str] | None = None  # running_context(), once asked

    def unsupported(self, case: Case) -> str | None:
        if case.kind is CaseKind.BLACKBOX:
            if case.recipe in LIFE_RECIPES and (self.served is None or LONG not in self.served.programs):
                return ("a request-life case runs the programs of a forced checkpoint that holds the long "
                        "program: serve one (`decodespec checkpoints build`) and pass it with --checkpoint DIR")
            return missing_capabilities(self, case)
        if blocker := http_blocker(case):
            return f"cannot run over HTTP: {blocker}"
        if self.served is None:
            return NO_CHECKPOINT
        if case.id not in self.served.programs:
            return f"compiled into the {group_of(case)} checkpoint; this server serves {self.served.group}"
        if why := lacking(case, self.without):
            return why
        if (need := served_context(case, self.served)) is not None:
            return context_unmet(case, need, self.context, self.running_context, who="the server",
                                 how="decodespec conform --launch-context CMD; a preset's `context` command does it: "
                                     "decodespec conform --list-presets",
                                 differs=" (llama.cpp rounds a context up to a multiple of 256)")
        return None

    def running_context(self) -> tuple[int | None, str]:
        """The context length the server says it runs with, and where it says so (CONTEXT_SOURCES, the
        first that answers with a number); (None, where it looked) when none does. Asked once."""
        if self._running_context is None:
            found: tuple[int | None, str] = (None, "it answers none of " + ", ".join(
                f"GET {path} {'.'.join(map(str, keys))}" for path, keys in CONTEXT_SOURCES))
            answers: dict[str, Any] = {}
            for path, keys in CONTEXT_SOURCES:
                if path not in answers:
                    try:
                        r = whole_answer(self.client, "GET", path, timeout=5)
                        answers[path] = r.json() if r.status_code == 200 else None
                    except (httpx.HTTPError, ValueError):
                        answers[path] = None
                value = answers[path]
                for key in keys:
                    value = _at(value, key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found = (value, f"GET {path} {'.'.join(map(str, keys))}")
                    break
            self._running_context = found
        return self._running_context

    def precheck(self) -> None:
        """Fail fast, with one message, when nothing answers at the URL (a typo, a server not up)."""
        try:
            r = whole_answer(self.client, "GET", "/v1/models", timeout=5)
        except httpx.HTTPError as exc:
            raise ServerError(f"nothing answers at {self.url}: {type(exc).__name__}: {exc} (is the server running, "
                              "and is the URL right?)") from None
        if r.status_code != 200:
            raise ServerError(f"{self.url}/v1/models answered {r.status_code}: {_trim(r.text, 200)!r}; "
                              "is this an OpenAI-compatible server?")
        _ = self.model  # a model list the cases cannot use fails here, once, not in every case

    def about(self) -> dict[str, Any]:
        """The server as a reproducer names it: URL, model name, version (from /version or /props
        where the server has one), the launch command and the checkpoint's group and content hash."""
        if self._about is None:
            info: dict[str, Any] = {"url": self.url, "model": self.model}
            for path in ("/version", "/props"):
                try:
                    r = whole_answer(self.client, "GET", path, timeout=5)
                    data = r.json() if r.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    data = None
                if isinstance(data, dict) and (v := data.get("version") or data.get("build_info")):
                    info["version"] = str(v)
                    break
            if self.launch:
                info["launch"] = self.launch
            if self.served is not None:
                info["checkpoint"] = {"group": self.served.group, "sha256": digest(self.served.folder)}
            self._about = info
        return self._about

    @property
    def checkpoint(self) -> Checkpoint:
        """The forced checkpoint served, where a script case or the recipe program reads it; a
        CaseError where none was given (`unsupported` says so before a script case runs)."""
        if self.served is None:
            raise CaseError(NO_CHECKPOINT)
        return self.served

    @property
    def model(self) -> str:
        if self._model is None:
            r = self._send("GET", "/v1/models")
            try:
                listed = r.json()
            except ValueError:
                raise ServerError(f"GET {self.url}/v1/models answered {r.status_code} without JSON: {_trim(r.text, 300)!r}") from None
            data = listed.get("data") if isinstance(listed, dict) else None
            first = data[0] if isinstance(data, list) and data else None
            if not isinstance(first, dict) or not isinstance(first.get("id"), str):
                said = "lists no model" if data == [] else (f"is not a model list ({{\"data\": [{{\"id\": ...}}]}}): "
                                                            f"{_trim(r.text, 200)!r}")
                raise ServerError(f"{self.url}/v1/models {said}; pass --model")
            self._model = first["id"]
        return self._model

    # ---- transport: bounded retries on connection errors, every exchange recorded ----------------

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request, sent again (at most `retries` times) when the connection fails. A retry is
        never silent: each one goes into the running case's log, where it becomes a finding."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                return whole_answer(self.client, method, path, **kw)  # bounded as a whole
            except httpx.TransportError as exc:
                last = exc
                self._dropped(f"{method} {path}: {type(exc).__name__}: {exc}")
                time.sleep(0.2 * (attempt + 1))
        raise ServerError(f"{method} {self.url}{path}: {type(last).__name__}: {last} (after {self.retries + 1} tries)")

    def log_exchanges(self, entries: list[dict[str, Any]]) -> None:
        """Add exchanges recorded apart (a sweep's failing limits) to the running case's log."""
        log = getattr(self._case, "log", None)
        if log is not None:
            log.extend(entries)

    def _dropped(self, what: str) -> None:
        log = getattr(self._case, "log", None)
        if log is not None:
            log.append({"connection_failed": what})

    # ---- requests --------------------------------------------------------------------------

    def prompt_for(self, ids: list[int]) -> list[int] | str:
        """The prompt field for `ids`: the ids themselves, or their text where the server refuses
        token-id prompts (llama-cpp-python's and transformers' servers take strings only). Which one
        is probed once, on the recipe program; the caller checks usage.prompt_tokens either way."""
        if self._id_prompts is None:
            probe = self.program_prompt() or ids
            body = {"model": self.model, "max_tokens": 1, "temperature": 0}
            status, _, raw = self.post("/v1/completions", {**body, "prompt": probe}, log=[])  # a probe, not the case
            self._id_prompts = status == 200
            if not self._id_prompts:
                text = self.checkpoint.tokenizer.decode(probe, skip_special=False)
                if self.post("/v1/completions", {**body, "prompt": text}, log=[])[0] == 200:
                    self.prompt_note = (f"the server refuses token-id prompts ({status}: {_trim(raw, 120)!r}); "
                                        "prompts are sent as their text")
                else:
                    self._id_prompts = True  # neither works: send ids and let the answer show why
        return ids if self._id_prompts else self.checkpoint.tokenizer.decode(ids, skip_special=False)

    def prefix(self) -> Any:
        """What this server puts before a prompt (script_check.Prefix, D26), probed once
        (http_script.probe_prefix)."""
        if self._prefix is None:
            self._prefix = probe_prefix(self)
        return self._prefix

    def program_prompt(self) -> list[int] | None:
        """The recipe program's prompt ids on a forced checkpoint (its script is varied text)."""
        prog = self.served.programs.get(RECIPE) if self.served else None
        return list(prog.prompt) if prog else None

    def body(self, case: Case, *, stream: bool, **over: Any) -> dict[str, Any]:
        inp = case.inputs
        chat = inp.get("endpoint") == "chat"
        b: dict[str, Any] = {"model": self.model, "max_tokens": inp.get("max_tokens", 24), "temperature": 0,
                             "stream": stream}
        ids = self.program_prompt()
        if ids is not None:  # run the recipe program to its EOS, so no limit cuts a character in two
            b["max_tokens"] = len(self.checkpoint.programs[RECIPE].script)
        if chat:
            text = inp["prompt"] if ids is None else self.checkpoint.tokenizer.decode(ids, skip_special=False)
            b["messages"] = [{"role": "user", "content": text}]
            b["logprobs"] = True
        else:
            b["prompt"] = inp["prompt"] if ids is None else self.prompt_for(ids)
            b["logprobs"] = 1
        b.update(over)
        return {k: v for k, v in b.items() if v is not None}

    def path(self, case: Case) -> str:
        return "/v1/chat/completions" if case.inputs.get("endpoint") == "chat" else "/v1/completions"

    def post(self, path: str, body: dict[str, Any], log: list[dict[str, Any]] | None = None) -> tuple[int, Any, str]:
        """POST a non-streamed request: (status, JSON body or None, raw text)."""
        r = self._send("POST", path, json=body)
        try:
            data = r.json()
        except ValueError:
            data = None
        log = log if log is not None else getattr(self._case, "log", None)
        if log is not None:
            log.append({"request": {"path": path, "body": body}, "status": r.status_code,
                        "response": trim_middle(r.text)})
        return r.status_code, data, r.text

    def complete(self, case: Case, log: list[dict[str, Any]] | None = None, **over: Any) -> Answer:
        """The case's request, not streamed. On a forced checkpoint its usage.prompt_tokens is held
        against the prompt the engine ran (script_check.prompt_placed, D26): another prompt is
        PromptAltered; a miscount of the one it ran is kept for the case's findings."""
        body = self.body(case, stream=False, **over)
        status, data, raw = self.post(self.path(case), body, log)
        if status != 200 or not isinstance(data, dict) or not data.get("choices"):
            raise ServerError(f"POST {self.path(case)} answered {status}: {_trim(raw, 500)!r}")
        ans = _answer(data)
        ids = self.program_prompt()
        if ids is not None:
            sent = token_count(ans.usage, "prompt_tokens")
            if sent is not None:
                placed = prompt_placed(sent, len(ids), self.prefix(), as_text=not isinstance(body.get("prompt"), list))
                if placed.changed:
                    raise PromptAltered(f"on {self.path(case)}: {placed.changed} (a chat template or a BOS)")
                if placed.miscounted:
                    self._case.miscounted = placed.miscounted
            if ans.tokens is None:
                ans.tokens = self.program_tokens(ans.text)
        return ans

    def program_tokens(self, text: str) -> list[str] | None:
        """The recipe program's token texts, as far as they spell `text` (a server without logprobs)."""
        prog = self.checkpoint.programs[RECIPE]
        pieces = _split_text([self.checkpoint.tokenizer.token_bytes(t) for t in prog.script[:-1]])
        out, spelled = [], ""
        for p in pieces:
            if spelled == text:
                break
            out.append(p)
            spelled += p
        return out if out and spelled == text else None

    def stream(self, case: Case, *, stop_after: int | None = None, log: list[dict[str, Any]] | None = None,
               **over: Any) -> Streamed:
        return self.stream_body(self.path(case), self.body(case, stream=True, **over), stop_after=stop_after, log=log)

    def stream_body(self, path: str, body: dict[str, Any], *, stop_after: int | None = None,
                    log: list[dict[str, Any]] | None = None) -> Streamed:
        """POST with stream=true and parse the SSE by hand; `stop_after` n deltas drops the connection."""
        out = Streamed()
        raw: list[str] = []
        for attempt in range(self.retries + 1):
            try:
                with self.client.stream("POST", path, json=body) as r:
                    out.status = r.status_code
                    if r.status_code != 200:
                        out.error = _trim(r.read().decode("utf-8", "replace"), 500)
                        raw.append(out.error)
                        break
                    watch = Watch.of(body, self.timeout)
                    for line in sse_lines(r.iter_text()):
                        raw.append(line)
                        feed(out, line)
                        watch.check(out)
                        if stop_after is not None and len(out.deltas) >= stop_after:
                            break  # leaving the block closes the connection mid-stream
                    else:
                        body_ended(out)
                break
            except StreamOverrun as exc:  # never sent again: it would run on again
                raise ServerError(f"POST {path} (stream): {exc}") from None
            except httpx.TransportError as exc:
                self._dropped(f"POST {path} (stream): {type(exc).__name__}: {exc}")
                if out.chunks or attempt == self.retries:
                    raise ServerError(f"POST {path} (stream): {type(exc).__name__}: {exc}") from None
                out, raw = Streamed(), []
                time.sleep(0.2 * (attempt + 1))
        log = log if log is not None else getattr(self._case, "log", None)
        if log is not None:
            log.append({"request": {"path": path, "body": body}, "status": out.status, "sse": trim_middle("\n".join(raw))})
        return out

    def run(self, case: Case) -> Outcome:
        recipe = run_script if case.kind is CaseKind.SCRIPT else RECIPES.get(case.recipe or "")
        if recipe is None:
            return Outcome(skip=f"this adapter has no recipe {case.recipe!r}")
        log: list[dict[str, Any]] = []  # every request this case sends, with its raw answer
        self._case.log = log
        self._case.miscounted = None
        try:
            if (ids := self.program_prompt()) is not None and case.inputs.get("endpoint") == "chat":
                self._check_chat(case, ids)
            out = recipe(self, case)
        except PromptAltered as exc:
            out = Outcome(skip=str(exc))
        except Exception as exc:  # its ERROR keeps the exchanges so far (the server as far as it is known)
            raise RunRaised(exc, log, self._about) from exc
        finally:
            self._case.log = None
        if self._case.miscounted and out.judged:
            out = attrs.evolve(out, findings=(*out.findings, finding("prompt_count", self._case.miscounted)))
        if not out.skip:  # a retried connection is a finding, never silent
            out = attrs.evolve(out, findings=(*out.findings, *retried_connections(log)))
        return attrs.evolve(out, exchanges=tuple(log), server=self.about())

    def _check_chat(self, case: Case, ids: list[int]) -> None:
        """On a forced checkpoint the chat endpoint must render the message as its bare content
        (the checkpoint's own template), or the marker is not at position 0: then PromptAltered.
        `ids`: the recipe program's prompt."""
        if self._chat_ok is None:
            status, data, raw = self.post(self.path(case), self.body(case, stream=False, max_tokens=1), log=[])
            sent = ((data or {}).get("usage") or {}).get("prompt_tokens") if isinstance(data, dict) else None
            self._chat_ok = "" if status == 200 and sent == len(ids) else (
                f"the chat endpoint did not take the recipe program's message as its {len(ids)} prompt id(s) "
                f"(answer {status}, prompt_tokens {sent}: {_trim(raw, 200)!r}); its chat template wraps the "
                "message, so the forced checkpoint cannot steer chat here")
        if self._chat_ok:
            raise PromptAltered(self._chat_ok)

    def reference(self, case: Case) -> Any:
        """The reference loop's Result for `case` on the served checkpoint (computed once)."""
        if case.id not in self._reference:
            self._reference[case.id] = reference_result(case, self.checkpoint)
        return self._reference[case.id]


def retried_connections(log: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """The connections a case's log records as failed and sent again, as one finding (none: []); a
    record that says it was not sent again (`"sent_again": false`: a connection the case broke on
    purpose, life/failover.py) is the case's own evidence."""
    failed = [e["connection_failed"] for e in log if "connection_failed" in e and e.get("sent_again", True)]
    return [finding("connection_dropped", f"{len(failed)} connection(s) failed and the request was sent again: "
                                          f"{failed[:3]}")] if failed else []


def _answer(data: dict[str, Any]) -> Answer:
    """A non-streamed answer with choices; one whose fields are not of the API's types (wire.ANSWER)
    cannot be judged: a ServerError that names the field."""
    if (why := shape_error(data, ANSWER)) is not None:
        raise ServerError(f"the answer's {why}: {_trim(json.dumps(data, ensure_ascii=False), 300)!r}")
    choice = data["choices"][0]
    chat = "message" in choice
    text = ((choice.get("message") or {}).get("content") or "") if chat else (choice.get("text") or "")
    return Answer(text, choice.get("finish_reason"), data.get("usage"), logprob_tokens(choice.get("logprobs"), text))


def logprob_tokens(logprobs: Any, text: str) -> list[str] | None:
    """The token strings a response reveals through logprobs, when they spell its text.

    Shapes read: the completions legacy object (`tokens` list: vLLM, llama-cpp-python), a
    `content` list of `{token, bytes}` (chat; llama-server on both endpoints), and null. Where
    `bytes` are given they are used, so tokens that split a character still spell the text; an
    entry whose `bytes` is null is a token with no bytes (the EOS, as decodespec serve sends it).
    """
    if not isinstance(logprobs, dict):
        return None
    if isinstance(logprobs.get("content"), list):
        items = logprobs["content"]
        pieces = [p for p in map(_entry_bytes, items) if p is not None]
        if items and len(pieces) == len(items):
            toks = _split_text(pieces)
        else:
            toks = [c.get("token", "") if isinstance(c, dict) else "" for c in items]
    else:
        toks = [t for t in logprobs.get("tokens") or [] if isinstance(t, str)]
    return toks if toks and "".join(toks) == text else None


def _entry_bytes(entry: Any) -> bytes | None:
    """A chat logprobs entry's bytes: its byte values, nothing where `bytes` is null (OpenAI's API
    sends null for a token with no bytes representation), None where the entry gives neither."""
    if isinstance(entry, dict) and "bytes" in entry and entry["bytes"] is None:
        return b""
    return byte_values(entry.get("bytes")) if isinstance(entry, dict) else None


def _split_text(pieces: list[bytes]) -> list[str]:
    """Token byte pieces as text: a split character belongs to the token that completes it."""
    out, buf = [], b""
    for p in pieces:
        buf += p
        try:
            out.append(buf.decode("utf-8"))
            buf = b""
        except UnicodeDecodeError:
            out.append("")
    return out if not buf else []


# ---- recipes ------------------------------------------------------------------------------------


def _outcome(ans: Answer | None, st: Streamed | None, findings: list[Finding], notes: tuple[str, ...] = (),
             not_checked: tuple[str, ...] = ()) -> Outcome:
    return Outcome(output=ans.text.encode() if ans else None, chunks=tuple(d.encode() for d in st.deltas) if st else None,
                   finish_reason=ans.finish_reason if ans else None, findings=tuple(merge(findings)), notes=notes,
                   not_checked=not_checked, judged=True)


def _stop_expected(base: str, stops: list[str], cut: str, *, max_tokens: int, selected: int = -1) -> Expected:
    """What a stop recipe expects: the unconstrained text `base` cut at `cut`, ended by the stop."""
    win = next((s for s in stops if base.startswith(cut + s)), stops[0])
    return Expected(output=cut.encode(), reason="stop_sequence", wire_reason="stop", selected=selected,
                    max_tokens=max_tokens, script_text=base.encode(), stops=tuple(s.encode() for s in stops),
                    stop=win.encode())


def _check_stop(a: OpenAIAdapter, case: Case, base: str, stops: list[str], expected: str, *, selected: int = -1,
                **over: Any) -> tuple[Answer, Streamed, list[Finding]]:
    """Send the stops both ways; judge each answer's bytes, the two against each other, and the reason."""
    ans = a.complete(case, stop=stops, **over)
    st = a.stream(case, stop=stops, **over)
    exp = _stop_expected(base, stops, expected, max_tokens=over.get("max_tokens", a.body(case, stream=False)["max_tokens"]),
                         selected=selected)
    found = compare_text(exp, ans.text.encode(), "non-streamed text") + compare_text(exp, st.text.encode(), "stream")
    found += compare_stream(ans.text.encode(), st.text.encode())
    found += compare_reason(exp, ans.finish_reason, "non-streamed answer", count=(ans.usage or {}).get("completion_tokens"),
                            text_agrees=ans.text.encode() == exp.output)
    found += compare_reason(exp, st.finish_reasons[-1] if st.finish_reasons else None, "stream", count=None,
                            text_agrees=st.text.encode() == exp.output)
    return ans, st, found + wire_findings(st)


def stream_agrees(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.5: the concatenated stream equals the non-streamed text."""
    ans, st = a.complete(case), a.stream(case)
    return _outcome(ans, st, compare_stream(ans.text.encode(), st.text.encode()) + wire_findings(st))


def stream_framing(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.7: one finish chunk, nothing after it; the API's framing ([DONE], JSON lines) as wire findings."""
    st = a.stream(case)
    f = terminal_findings(st)
    if st.empty_deltas:
        f.append(finding("empty_delta", f"{st.empty_deltas} chunk(s) carry empty text and no finish_reason"))
    return _outcome(None, st, f + wire_findings(st))


def _token_bounds(a: OpenAIAdapter, base: Answer) -> tuple[list[str] | None, str]:
    """The token texts of the unconstrained answer: the forced program's own (exact) or logprobs'."""
    if a.program_prompt() is not None:
        toks = a.program_tokens(base.text)
        if toks is not None:
            return toks, "tokens of the forced recipe program"
    return base.tokens, "tokens from logprobs"


def stop_cross_token(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.6: a stop across a token boundary of the unconstrained output."""
    base = a.complete(case)
    t = base.text
    if not t:  # e.g. a chat answer all of whose text a reasoning parser sent as reasoning_content (D45)
        return Outcome(skip=f"the unconstrained answer has no text ({case.inputs.get('endpoint', 'completions')} "
                            f"endpoint, finish_reason {base.finish_reason!r}; a chat answer's text may have gone to "
                            "reasoning_content), so no stop can be placed in it")
    toks, _ = _token_bounds(a, base)
    notes: tuple[str, ...] = ()
    bounds = []
    if toks:
        pos = 0
        for tok in toks[:-1]:
            pos += len(tok)
            bounds.append(pos)
    else:
        return Outcome(skip="the server reveals no tokens (logprobs) and serves no forced program, so no stop "
                            "can be placed across a token boundary")
    bounds.sort(key=lambda b: abs(b - len(t) // 2))
    for b in bounds:
        lo, hi = max(0, b - 2), min(len(t), b + 2)  # up to two characters each side, at least one
        stop = t[lo:hi]
        if lo < b < hi and stop.strip() and t.find(stop) == lo:
            ans, st, f = _check_stop(a, case, t, [stop], t[:lo])
            return _outcome(ans, st, f, notes + (f"unconstrained text {t!r}; stop {stop!r} across offset {b}",))
    return Outcome(skip=f"no stop string across a token boundary could be chosen from {t!r}")


def stop_multi_byte(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.6: a stop that is a multi-byte character of the output."""
    t = a.complete(case).text
    p = next((i for i, ch in enumerate(t) if i > 0 and len(ch.encode()) > 1), None)
    if p is None:
        return Outcome(skip=f"the unconstrained output has no multi-byte character after its first: {t!r}")
    ans, st, f = _check_stop(a, case, t, [t[p]], t[: t.find(t[p])])
    return _outcome(ans, st, f, (f"unconstrained text {t!r}; stop {t[p]!r}",))


def stop_overlap(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.6 (D3): overlapping stops, the later-ending one listed first; the earliest end wins."""
    t = a.complete(case).text
    for i in sorted(range(len(t) - 5), key=lambda i: abs(i - len(t) // 3)):
        s1, s2 = t[i : i + 4], t[i + 2 : i + 6]
        if s1.strip() and s2.strip() and t.find(s1) == i and t.find(s2) == i + 2:
            ans, st, f = _check_stop(a, case, t, [s2, s1], t[:i])
            return _outcome(ans, st, f, (f"unconstrained text {t!r}; stops {[s2, s1]!r}",))
    return Outcome(skip=f"no two overlapping stops could be chosen from {t!r}")


def stop_last_token(a: OpenAIAdapter, case: Case) -> Outcome:
    """D4: a stop completed by the last allowed token reports 'stop', not 'length'.

    The stop must end exactly on token k = max_tokens: chosen from the forced program's own tokens
    (or logprobs), with token k non-empty and the stop found nowhere earlier; a server that reports
    usage must then show k tokens, or the condition did not occur and the case is n/a."""
    base = a.complete(case)
    toks, how = _token_bounds(a, base)
    if not toks:
        return Outcome(skip="the server reveals no tokens (logprobs), so the last allowed token is unknown")
    for k in range(len(toks) // 2, len(toks)):
        prefix = "".join(toks[:k])
        stop = prefix[-2:]
        if (toks[k - 1] and len(prefix) >= 3 and stop.strip() and base.text.find(stop) == len(prefix) - 2
                and len(toks[k - 1]) <= 2):
            ans, st, f = _check_stop(a, case, base.text, [stop], prefix[:-2], selected=k, max_tokens=k)
            n = (ans.usage or {}).get("completion_tokens")
            if n is not None and n < k and not f:
                return Outcome(skip=f"the stop {stop!r} ended on token {n}, not on the last allowed token {k} "
                                    f"({how}): the condition of the case did not occur")
            missed = () if n is not None else ("that the stop ended on token k (the server reports no usage)",)
            return _outcome(ans, st, f, (f"stop {stop!r} ends token {k} ({how}); max_tokens {k}",), missed)
    return Outcome(skip=f"no stop ending exactly on a token could be chosen from {base.text!r}")


def max_tokens_exact(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.3: max_tokens k gives exactly k tokens, reason 'length', a prefix of the greedy text."""
    base = a.complete(case)
    n = (base.usage or {}).get("completion_tokens") or len(base.tokens or []) or case.inputs.get("max_tokens", 24)
    k = max(1, min(5, n - 1))
    ans = a.complete(case, max_tokens=k)
    exp = Expected(output=ans.text.encode(), reason="max_output_tokens", wire_reason="length", selected=k,
                   max_tokens=k, script_text=base.text.encode())
    f = compare_reason(exp, ans.finish_reason, f"{k}-token answer", count=(ans.usage or {}).get("completion_tokens"))
    got = (ans.usage or {}).get("completion_tokens")
    if got is not None and got > k:
        f.append(finding("past_limit", f"max_tokens {k}: usage.completion_tokens is {got}"))
    elif got is not None and got < k:
        f.append(finding("early_length", f"max_tokens {k} below the natural length {n}: usage.completion_tokens is {got}"))
    if not base.text.startswith(ans.text):
        f.append(finding("bytes_replaced", f"the {k}-token text {ans.text!r} is not a prefix of the greedy text {base.text!r}"))
    return _outcome(ans, None, f, (f"k={k}, natural length {n}",))


def eos_last_token(a: OpenAIAdapter, case: Case) -> Outcome:
    """D4: EOS as the last allowed token reports 'stop', not 'length'."""
    base = a.complete(case, max_tokens=64)
    n = (base.usage or {}).get("completion_tokens")
    if a.program_prompt() is not None:  # on a forced checkpoint the EOS step is known, whatever usage counts
        n = len(a.checkpoint.programs[RECIPE].script)
    if base.finish_reason != "stop" or not n:
        return Outcome(skip=f"the model did not end by itself within 64 tokens (finish_reason {base.finish_reason!r})")
    ans = a.complete(case, max_tokens=n)
    exp = Expected(output=base.text.encode(), reason="eos", wire_reason="stop", selected=n, max_tokens=n,
                   script_text=base.text.encode())
    return _outcome(ans, None, compare_reason(exp, ans.finish_reason, f"answer with max_tokens {n}", count=None))


def usage(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.10: usage present and consistent, streamed usage equal to the non-streamed one."""
    ans = a.complete(case)
    st = a.stream(case, stream_options={"include_usage": True})
    f = []
    u = ans.usage or {}
    if not {"prompt_tokens", "completion_tokens"} <= set(u):
        f.append(finding("usage_missing", f"usage lacks prompt/completion counts: {u}"))
    elif u.get("total_tokens") is not None and u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]:
        f.append(finding("usage_total", f"total_tokens {u['total_tokens']} != prompt + completion in {u}"))
    keys = ("prompt_tokens", "completion_tokens")
    if st.usage is not None and {k: st.usage.get(k) for k in keys} != {k: u.get(k) for k in keys}:
        f.append(finding("usage_stream", f"streamed usage {st.usage} differs from non-streamed {u}"))
    f += [no_usage_chunk()] if usage_chunk_missing(st) else []
    return _outcome(ans, st, f + wire_findings(st))


def bad_input(a: OpenAIAdapter, case: Case) -> Outcome:
    """§4.1 (CREATED -> reject): malformed requests get a 4xx, and the server keeps serving."""
    f = []
    # -1 means "no limit" to llama.cpp (documented); -2 is out of range on every server.
    for over in ({"max_tokens": -2}, {"stop": 5}, {"temperature": "hot"}):
        status, _, raw = a.post(a.path(case), a.body(case, stream=False, **over))
        if not 400 <= status < 500:
            f.append(finding("accepted_bad_input", f"{over} answered {status}, expected a 4xx: {_trim(raw, 200)!r}"))
    try:
        a.complete(case, max_tokens=2)
    except (httpx.HTTPError, ServerError) as exc:
        f.append(finding("case_check", f"after bad requests the server no longer serves: {exc}", invariant=case.invariant))
    return _outcome(None, None, f)


def max_tokens_zero(a: OpenAIAdapter, case: Case) -> Outcome:
    """D18: max_tokens 0 selects no token. A 4xx refusal (the reference's answer) or an empty 'length'
    answer with completion_tokens 0 conform; one token, or a run to EOS, breaks length_respected."""
    status, data, raw = a.post(a.path(case), a.body(case, stream=False, max_tokens=0))
    if 400 <= status < 500:
        return _outcome(None, None, [], (f"refused with {status} (D18): {_trim(raw, 160)!r}",))
    if status != 200 or not isinstance(data, dict) or not data.get("choices"):
        return _outcome(None, None, [finding("unexpected_error", f"max_tokens 0 answered {status}: {_trim(raw, 200)!r}")])
    ans = _answer(data)
    n = (ans.usage or {}).get("completion_tokens")
    f = []
    if ans.text or (n or 0) > 0:
        f.append(finding("past_limit", f"max_tokens 0 answered {n if n is not None else 'some'} token(s): {ans.text!r} "
                                       f"(finish_reason {ans.finish_reason!r})"))
    elif ans.finish_reason != "length":
        f.append(finding("stop_without_hit", f"max_tokens 0 answered no text with finish_reason {ans.finish_reason!r}; "
                                             "no stop or EOS was selected, so D18 gives 'length'"))
    return _outcome(ans, None, f, (f"answered 200 with completion_tokens {n}",))


def keep_alive(a: OpenAIAdapter, case: Case) -> Outcome:
    """RFC 9112 §9.3 under §4.7 streams: hundreds of streamed requests on one persistent connection.
    A connection the server closes without `Connection: close` (the next request on it fails) is a
    finding with its count; nothing is retried silently. Bounded: `requests` and 120 s."""
    n = int(case.inputs.get("requests", 200))
    parts = urlsplit(a.url)
    if (host := parts.hostname) is None:
        raise CaseError(f"the server's URL {a.url!r} names no host to connect to")
    body = json.dumps(a.body(case, stream=True, max_tokens=int(case.inputs.get("max_tokens", 4)))).encode()
    headers = {"Content-Type": "application/json"}

    def connect() -> http.client.HTTPConnection:
        return http.client.HTTPConnection(host, parts.port, timeout=30)

    conn, sent, answered, announced, dropped = connect(), 0, 0, 0, []
    case_s = 120
    deadline = time.monotonic() + case_s
    while sent < n and time.monotonic() < deadline:
        sent += 1
        try:
            conn.request("POST", a.path(case), body, headers)
            r = conn.getresponse()
            data = b""
            while piece := r.read1(65536):  # each read waits 30 s at most, and the whole case 120 s
                data += piece
                if time.monotonic() > deadline:
                    conn.close()
                    raise ServerError(f"request {sent}: its answer had not ended {case_s} s after the case began")
            answered += 1
            if answered == 1:  # the first exchange stands for all (they are the same request)
                a.log_exchanges([{"request": {"path": a.path(case), "body": json.loads(body)}, "status": r.status,
                                  "sse": trim_middle(data.decode("utf-8", "replace"))}])
            if r.status != 200 or b"data:" not in data:
                dropped.append(f"request {sent}: answered {r.status} without a stream")
            if r.will_close:
                announced += 1
                conn.close()
                conn = connect()
        except (http.client.HTTPException, OSError) as exc:
            dropped.append(f"request {sent}: {type(exc).__name__}: {exc}")
            conn.close()
            conn = connect()
    conn.close()
    notes = (f"{sent} streamed requests to {a.url}; {answered} answered; {announced} announced Connection: close "
             f"(a new connection followed); {len(dropped)} failed",)
    f = [finding("connection_dropped", f"{len(dropped)} of {sent} streamed requests on one keep-alive connection "
                                       f"failed: {dropped[:3]}")] if dropped else []
    return _outcome(None, None, f, notes)


RECIPES: dict[str, Callable[[OpenAIAdapter, Case], Outcome]] = {
    f.__name__: f for f in (stream_agrees, stream_framing, stop_cross_token, stop_multi_byte, stop_overlap,
                            stop_last_token, max_tokens_exact, eos_last_token, usage, bad_input,
                            max_tokens_zero, keep_alive)
}
RECIPES.update(LIFE_RECIPES)  # the request's life (concurrency, disconnect, resumption)
