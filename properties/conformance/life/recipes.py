"""The request-life recipes over HTTP, on a forced checkpoint (§4.7-§4.10).

Every recipe runs the checkpoint's own programs, so every answer is known: the script cases
compiled into it (mixed lengths, stops, limits, split characters) and the long program (480 tokens,
checkpoints.LONG). Answers under load are compared with the same request's answer alone, field by
field (status, text, finish reasons, token count, [DONE]): under greedy decoding on a forced
checkpoint nothing that runs beside a request may change it (§4.8: batching and preemption are not
a new generation). A mismatch is a finding that keeps both exchanges.

Recipes whose case says `"server": "tight"` run on a server started with its concurrency limited
to `slots` sequences and a KV budget too small for the load (`decodespec conform --launch-tight`,
a preset's `tight` command, presets.toml); elsewhere they are n/a, saying why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..adapters.base import Finding, Outcome
from ..cases import Case, CaseKind, load_cases
from ..checkpoints import LONG, RECIPE
from ..http_script import PATH, request_body, returned
from ..judgement import stream_text
from ..script_check import Returned, deviation
from ..script_server import LiveServer, program_body
from ..symptoms import Expected, compare_text, finding, merge, text_difference
from ..wire import first_choice, sse_number, terminal_findings, whole_answer, wire_findings
from .exchange import Exchange, Gauges, Job, burst, client, decoded, overlap, preemptions, read_metrics, running, send

# The model-checked properties (`decodespec check`, machine/checker.py: every interleaving of the
# tables, with a scheduler that parks, preempts and resumes) each black-box recipe approximates.
MODEL_CHECKED: Mapping[str, tuple[str, ...]] = {
    # §4.8: checked with 2-3 requests sharing the batch's places
    "batch_exact": ("refinement", "seq_contiguous", "single_terminal_event"),
    "terminal_under_load": ("single_terminal_event", "terminal_after_all_deltas", "no_delta_after_terminal"),  # §4.7
    "preemption": ("refinement", "seq_contiguous", "release_exactly_once"),  # §4.8: preempt and resume
    "disconnect_frees": ("no_leak", "release_exactly_once", "slot_reused_after_release"),  # §4.10 (witness)
    "disconnect_abort": ("no_select_after_cancel_observed", "transport_not_eos", "cancel_during_decode_discarded"),  # §4.9
    "resume": ("reader_delivery_complete", "seq_strictly_increasing", "reconnect_then_finish"),  # §4.7 rules 3-4
    "worker_failure": ("transport_not_eos", "single_terminal_event"),  # §4.7: a gateway's worker fails (failover.py)
}
SHOWN = 4  # mismatching pairs whose exchanges a report keeps


def _model_checked(recipe: str) -> str:
    return (f"approximates the model-checked {', '.join(MODEL_CHECKED[recipe])} (`decodespec check`: every "
            "interleaving of the tables; here one run, black box)")


def _timeout(case: Case) -> float:
    return float(case.inputs.get("timeout_s", 300))


# ---- the programs, alone ---------------------------------------------------------------------------


def long_tokens(a: LiveServer, case: Case) -> int:
    """How many tokens a long request asks for: the case's `long_tokens` (ended by the limit, 'length'),
    else the whole script with its EOS ('stop')."""
    return int(case.inputs.get("long_tokens", len(a.checkpoint.programs[LONG].script)))


def long_body(a: LiveServer, case: Case, **over: Any) -> dict[str, Any]:
    return program_body(a, a.checkpoint.programs[LONG], long_tokens(a, case), **over)


def long_text(a: LiveServer, case: Case) -> str:
    """The long program's text up to the case's limit (its EOS adds none)."""
    script = a.checkpoint.programs[LONG].script
    return a.checkpoint.tokenizer.decode([t for t in script[:long_tokens(a, case)] if t != a.checkpoint.eos_id])


def mixed(a: LiveServer, case: Case) -> list[tuple[str, dict[str, Any]]]:
    """(program, body) for the long program, then every script case this server runs on its
    checkpoint (no request fields, no context limit: one server for all)."""
    out = [(c.id, request_body(a, c)) for c in load_cases() if c.kind is CaseKind.SCRIPT
           and c.id in a.checkpoint.programs and a.unsupported(c) is None and not c.inputs.get("request")
           and "context_limit" not in c.inputs]
    return [(LONG, long_body(a, case)), *out]


def jobs_for(programs: Sequence[tuple[str, dict[str, Any]]], n: int, *, streamed: str) -> list[Job]:
    """n jobs cycling through the programs; `streamed` "all", or "mixed" (each program both ways)."""
    out = []
    for i in range(n):
        name, body = programs[i % len(programs)]
        stream = streamed == "all" or (i % len(programs) + i // len(programs)) % 2 == 1
        out.append(Job(name, PATH, {**body, "stream": stream}, stream))
    return out


ALONE_TRIES = 3


def alone(a: LiveServer, jobs: Sequence[Job], timeout_s: float) -> tuple[dict[tuple[str, bool], Exchange], list[Exchange]]:
    """Each distinct (program, streamed) of `jobs`, sent alone, one after another: the answers the load
    is judged against. One that got no answer at all (the connection failed before a status) is sent
    again, up to ALONE_TRIES in all, so that a dropped connection does not leave the load unjudged;
    the failed tries come back beside, for the findings (nothing is retried silently)."""
    out: dict[tuple[str, bool], Exchange] = {}
    failed: list[Exchange] = []
    with client(a.url, 2, timeout_s) as c:
        for job in jobs:
            if (job.name, job.stream) in out:
                continue
            for _ in range(ALONE_TRIES):
                ex = out[job.name, job.stream] = send(c, job)
                if not (ex.failed and ex.status == 0):
                    break
                failed.append(ex)
    return out, [ex for ex in failed if ex is not out[ex.job.name, ex.job.stream]]


def long_expected(a: LiveServer, case: Case) -> Expected:
    """The reference's answer to the long program alone up to the case's limit: its text, ended by
    the limit ('length'), or by its EOS when the whole script is asked for ('stop')."""
    prog, tok, eos = a.checkpoint.programs[LONG], a.checkpoint.tokenizer, a.checkpoint.eos_id
    n, whole = long_tokens(a, case), len(prog.script)
    return Expected(output=long_text(a, case).encode(), reason="eos" if n >= whole else "max_output_tokens",
                    wire_reason="stop" if n >= whole else "length", selected=min(n, whole), max_tokens=n,
                    script_text=tok.decode_bytes(list(prog.script[:-1])), eos_at=whole, eos_text=tok.token_bytes(eos))


def left_long(a: LiveServer, case: Case, solo: Mapping[tuple[str, bool], Exchange]) -> tuple[str | None, list[Finding]]:
    """D27: the long program alone must follow its script, else nothing here can be judged: (the
    ERROR, []). Where its text differs, its tokens decide (script_check.deviation on a request of its
    own asking for token ids and logprobs: the ids first, else the logprobs, else its text, D70): a
    run that left the script is that ERROR; one that followed it sent other text for the script's
    tokens, the engine's own finding, named by symptom (None, findings), and the load is judged as
    usual."""
    want = long_text(a, case)
    wrong = {stream: ex for (name, stream), ex in solo.items() if name == LONG and (ex.failed or ex.answer[1] != want)}
    if not wrong:
        return None, []
    for stream, ex in wrong.items():
        if ex.failed or ex.status != 200 or not isinstance(ex.answer[1], str):
            return _left(stream, None if ex.failed else ex.answer[1], want, ex), []
    status, data, _ = a.post(PATH, long_body(a, case, logprobs=1, return_token_ids=True), log=[])
    if 400 <= status < 500:  # a server that does not know return_token_ids: logprobs alone
        status, data, _ = a.post(PATH, long_body(a, case, logprobs=1), log=[])
    evidence = returned(first_choice(data)) if status == 200 else Returned()
    if evidence.text is None:
        stream, ex = next(iter(wrong.items()))
        return _left(stream, ex.answer[1], want, ex), []
    gone = deviation(a.checkpoint.programs[LONG], a.checkpoint.tokenizer, a.checkpoint.eos_id, evidence,
                     end=long_tokens(a, case))
    if gone is not None:
        return f"the long program alone: {gone.message}", []
    exp, found = long_expected(a, case), []
    for stream, ex in wrong.items():
        where = f"long program's {'stream' if stream else 'non-streamed text'} alone"
        if ex.streamed is not None:
            placed, text = stream_text(exp, [t.encode() for t in ex.streamed.texts],
                                       [t.encode() for t in ex.streamed.content_after_finish], where)
            found += placed + compare_text(exp, text, where)
        else:
            found += compare_text(exp, ex.answer[1].encode(), where)
        a.log_exchanges([{**ex.record(), "label": f"{_named(LONG, stream)} alone"}])
    return None, found


def _left(stream: bool, got: str | None, want: str, ex: Exchange) -> str:
    return (f"the long program alone ({_kind(stream)}) did not give its script's "
            f"text ({text_difference(got or '', want, 40)}; "
            f"status {ex.status}{', ' + ex.failed if ex.failed else ''}): precision, a sampling default, "
            "a prompt shift or a context the server cannot hold")


# ---- judging answers under load ------------------------------------------------------------------

_FIELDS = {True: ("status", "text", "finish reasons", "error", "error events", "[DONE]"),
           False: ("status", "text", "finish_reason", "completion_tokens")}


def _diff(solo: Exchange, got: Exchange) -> str:
    parts = []
    for name, x, y in zip(_FIELDS[got.job.stream], solo.answer, got.answer):
        if x != y:
            if isinstance(x, str) and isinstance(y, str):
                parts.append(f"{name}: {text_difference(y, x)}")
            else:
                parts.append(f"{name}: {y!r} for {x!r}")
    return "; ".join(parts)


def dropped(ex: Exchange, how: str) -> Finding:
    """A failed exchange: a stream the server had opened (200) that ended before any terminal event,
    closed or given up on by the reader (wire.Watch), has none (§4.7, `stream_cut`:
    single_terminal_event); any other failure, or one after
    the terminal, is the connection's (`connection_dropped`, a wire finding). Never sent again."""
    st = ex.streamed
    if st is not None and ex.status == 200 and not st.finish_reasons and not (st.error or st.error_events):
        done = ", then [DONE]" if st.done else ""
        return finding("stream_cut", f"{how}: the server answered 200, sent {len(st.deltas)} deltas{done} and "
                                     f"no finish chunk or error ({ex.failed}); not sent again")
    return finding("connection_dropped", f"{how}: {ex.failed}; not sent again")


def ended_alone(got: Sequence[Exchange], how: str, first: int = 1) -> list[Finding]:
    """§4.7 on the streams of `got` the server ended itself (the client did not cut them, the
    connection held): each has one terminal (wire.terminal_findings), whatever else the recipe
    judges of it; `how` and the number from `first` name them ('new stream 2')."""
    return [finding(f.symptom, f"{how} {i}: {f.message}") for i, x in enumerate(got, first)
            if x.streamed is not None and x.status == 200 and not x.failed and x.cut is None
            for f in terminal_findings(x.streamed)]


def _kind(stream: bool) -> str:
    return "streamed" if stream else "not streamed"


def _named(name: str, stream: bool) -> str:
    return f"{name} ({_kind(stream)})"


def against_alone(a: LiveServer, solo: Mapping[tuple[str, bool], Exchange], got: Sequence[Exchange],
                  where: str) -> list[Finding]:
    """Each answer under load against the same request alone; every stream's terminal (§4.7). The
    exchanges of the first SHOWN differences are kept, alone and under load side by side. A request
    that failed alone is a finding of its own (`dropped`); its answers under load are compared with
    nothing (`unjudged` says how many)."""
    found = [dropped(ref, f"{_named(name, stream)} alone") for (name, stream), ref in solo.items()
             if ref.failed and any((ex.job.name, ex.job.stream) == (name, stream) for ex in got)]
    shown = 0
    for i, ex in enumerate(got):
        ref = solo[ex.job.name, ex.job.stream]
        how = f"{ex.job.name} ({_kind(ex.job.stream)}, request {i + 1} of {len(got)} {where})"
        if ex.failed:
            found.append(dropped(ex, how))
        elif ref.failed or ex.answer == ref.answer:
            pass
        else:
            found.append(finding("batch_mismatch", f"{how}: {_diff(ref, ex)}"))
            if shown < SHOWN:
                shown += 1
                a.log_exchanges([{**ref.record(), "label": f"{ex.job.name} alone"}, {**ex.record(), "label": how}])
        if ex.streamed is not None and ex.status == 200 and not ex.failed:
            found += [finding(f.symptom, f"{how}: {f.message}") for f in terminal_findings(ex.streamed)]
            found += [f for f in wire_findings(ex.streamed) if f.symptom == "done_missing"]
    return merge(found)


def sent_again(retried: Sequence[Exchange]) -> list[Finding]:
    """The tries of `alone` that got no answer: the connection's findings, each named."""
    return [dropped(ex, f"{_named(ex.job.name, ex.job.stream)} alone, sent again") for ex in retried]


def unjudged(solo: Mapping[tuple[str, bool], Exchange], got: Sequence[Exchange]) -> list[str]:
    """What against_alone could not compare: the answers under load of each request that failed alone."""
    out = []
    for (name, stream), ref in solo.items():
        n = sum((ex.job.name, ex.job.stream) == (name, stream) for ex in got)
        if ref.failed and n:
            out.append(f"{n} answer(s) of {_named(name, stream)} under load: the same request alone failed "
                       f"({ref.failed}), so there was nothing to compare them with")
    return out


def _sample(got: Sequence[Exchange], a: LiveServer) -> None:
    """Keep one streamed and one non-streamed exchange of a burst as the evidence of a pass."""
    for stream in (True, False):
        ex = next((x for x in got if x.job.stream is stream and not x.failed), None)
        if ex is not None:
            a.log_exchanges([{**ex.record(), "label": f"{ex.job.name} under load (sample)"}])


def _outcome(found: list[Finding], notes: Sequence[str], recipe: str, not_checked: Sequence[str] = ()) -> Outcome:
    return Outcome(findings=tuple(found), notes=(*notes, _model_checked(recipe)), not_checked=tuple(not_checked),
                   judged=True)


def _load(a: LiveServer, case: Case, recipe: str, *, streamed: str,
          judge: Callable[[list[Finding], list[str], dict[str, float] | None, dict[str, float] | None], Outcome | None]
          | None = None) -> Outcome:
    """The shared flow: every job alone, then all at once while the gauges are sampled."""
    n, timeout_s = int(case.inputs["in_flight"]), _timeout(case)
    programs = mixed(a, case)
    longs = int(case.inputs.get("long", 0))  # jobs that are the long program, before the mix
    jobs = [*jobs_for(programs[:1], longs, streamed=streamed), *jobs_for(programs, n - longs, streamed=streamed)]
    solo, retried = alone(a, jobs, timeout_s)
    gone, wrong_text = left_long(a, case, solo)
    if gone:
        return Outcome(abort=gone, exchanges=tuple(e.record() for e in solo.values() if e.job.name == LONG))
    with client(a.url, 2, 10) as c:
        before = read_metrics(c)
    gauges = Gauges(a.url)
    t0 = time.monotonic()
    with gauges.sampling():
        got = burst(a.url, jobs, timeout_s=timeout_s)
    wall = time.monotonic() - t0
    with client(a.url, 2, 10) as c:
        after = read_metrics(c)
    found = merge(wrong_text + against_alone(a, solo, got, f"with {n} in flight") + sent_again(retried))
    unsure = unjudged(solo, got)
    _sample(got, a)
    streams = sum(j.stream for j in jobs)
    notes = [f"{n} requests at once ({streams} streamed, {n - streams} not) over {len(programs)} programs "
             f"({sum(j.name == LONG for j in jobs)} of them {long_tokens(a, case)} tokens of the long program); "
             f"all answered in {wall:.1f} s; at most {overlap(got)} streams were sending deltas at one instant; "
             f"{gauges.note()} (a run with -j against a given URL may run other cases beside this one; a "
             "launched run never does)",
             f"{len(found)} finding(s) against the same requests alone" if found else
             "every answer equals the same request's answer alone"]
    if judge is not None and (out := judge(found, notes, before, after)) is not None:
        return attrs.evolve(out, not_checked=(*out.not_checked, *unsure)) if out.judged else out
    return _outcome(found, notes, recipe, unsure)


# ---- the recipes ----------------------------------------------------------------------------------


def batch_exact(a: LiveServer, case: Case) -> Outcome:
    """§4.8: `in_flight` requests of mixed programs at once, streamed and not: each comes back exactly
    as it does alone (tokens and text, finish reason, token count, one terminal, [DONE])."""
    return _load(a, case, "batch_exact", streamed="mixed")


def terminal_under_load(a: LiveServer, case: Case) -> Outcome:
    """§4.7: `in_flight` streams at once: each ends with exactly one finish chunk, then [DONE]; a
    stream cut by a newer request without a finish_reason breaks single_terminal_event."""
    return _load(a, case, "terminal_under_load", streamed="all")


def preemption(a: LiveServer, case: Case) -> Outcome:
    """§4.8: on a server whose KV budget is too small for the load, every answer is still exact. The
    engine's preemption counter (/metrics) must have moved, or the case proved nothing: n/a."""
    if (why := _needs_tight(a, case)) is not None:
        return Outcome(skip=why)

    def judge(found: list[Finding], notes: list[str], before: dict[str, float] | None,
              after: dict[str, float] | None) -> Outcome | None:
        counted = {k: v - preemptions(before).get(k, 0.0) for k, v in preemptions(after).items()}
        if not counted:
            if found:
                return _outcome(found, notes, "preemption",
                                ("preemptions (the server counts none on /metrics or /engine_metrics)",))
            return Outcome(skip="the server counts no preemptions on /metrics or /engine_metrics, so nothing shows that "
                                f"the load made it preempt; {notes[0]}")
        notes.append("preemptions counted: " + ", ".join(f"{k} +{v:g}" for k, v in sorted(counted.items())))
        if not any(counted.values()) and not found:
            return Outcome(skip=f"no preemption happened under this load ({notes[-1]}): the case proved nothing")
        return None

    return _load(a, case, "preemption", streamed="mixed", judge=judge)


def _needs_tight(a: LiveServer, case: Case) -> str | None:
    if case.inputs.get("server") == "tight" and not a.tight:
        return ("it needs the server started with its concurrency limited and a KV budget too small for the load "
                "(decodespec conform --launch-tight CMD; a preset's `tight` command does it: decodespec conform "
                "--list-presets)")
    return None


def _cancel_endpoint(c: Any, ex: Exchange) -> str:
    """D5: where the server names the request (X-Request-Id) and has a cancel endpoint, the client that
    leaves calls it; the answer says what happened."""
    rid = ex.headers.get("x-request-id")
    if not rid:
        return "no X-Request-Id: disconnect only"
    r = whole_answer(c, "POST", f"/v1/requests/{rid}/cancel")
    return f"POST /v1/requests/{rid}/cancel answered {r.status_code}"


def abandon(a: LiveServer, case: Case) -> tuple[dict[str, Any], list[Finding]] | Outcome:
    """The disconnect flow (§4.9, §4.10), measured:

    1. the long stream alone: how long its rest takes after its `cut_at`-th delta (`rest_s`; with
       other streams beside it an engine is slower, so this is a lower bound);
    2. `slots` long streams at once, each closed after `cut_at` deltas (and cancelled where the
       server names the request and has a cancel endpoint, D5);
    3. the engine's /metrics watched for a moment (`_watch`): its running gauges back at their level
       before (`freed_s`)? its per-step decode counter still moving late in that moment (`decoded_late`)?
    4. at once `slots` new streams: the recipe program, and one long stream (the bystander, which
       must equal its answer alone): how long after the last disconnect the last of them sends its
       first delta (`reuse_s`); a stream that has not started within `bound_s` is late.
    """
    if (why := _needs_tight(a, case)) is not None:
        return Outcome(skip=why)
    s, k, bound = int(case.inputs["slots"]), int(case.inputs["cut_at"]), float(case.inputs["bound_s"])
    timeout_s = _timeout(case)
    long_stream = Job(LONG, PATH, long_body(a, case, stream=True), True)
    solo, retried = alone(a, [long_stream], timeout_s)
    gone, wrong_text = left_long(a, case, solo)
    if gone:
        return Outcome(abort=gone, exchanges=tuple(e.record() for e in solo.values()))
    ref = solo[LONG, True]
    n = long_tokens(a, case)
    rest_s = (ref.done - ref.first) * (n - k) / max(n - 1, 1) if ref.first and ref.done else 0.0
    with client(a.url, s + 4, timeout_s) as c:
        before = running(read_metrics(c) or {})
        cut = burst(a.url, [attrs.evolve(long_stream, cut_after=k) for _ in range(s)], timeout_s=timeout_s)
        told = sorted({_cancel_endpoint(c, x) for x in cut if not x.failed})
        t_gone = max((x.cut or x.done or x.sent) for x in cut)
        freed_s, decoded_late = _watch(c, before, t_gone, _watch_s(rest_s))
    recipe = a.checkpoint.programs[RECIPE]
    short = program_body(a, recipe, len(recipe.script), stream=True)
    fresh = burst(a.url, [long_stream, *(Job(RECIPE, PATH, short, True) for _ in range(s - 1))], timeout_s=bound)
    late = [i + 1 for i, x in enumerate(fresh) if x.first is None or x.first - t_gone > bound]
    starts = [x.first - t_gone for x in fresh if x.first is not None]
    found = wrong_text + against_alone(a, solo, [x for x in fresh[:1] if x.first is not None], "beside the new streams")
    found += sent_again(retried)
    found += [dropped(x, f"new stream {i + 1}") for i, x in enumerate(fresh) if x.failed and "Timeout" not in x.failed]
    # an abandoned stream the server ended before its cut, and the new streams beside the bystander
    found += ended_alone(cut, "abandoned stream") + ended_alone(fresh[1:], "new stream", first=2)
    a.log_exchanges([{**cut[0].record(), "label": f"abandoned after {k} deltas"},
                     {**fresh[-1].record(), "label": "a new stream after the disconnects"}])
    m = {"slots": s, "cut_at": k, "bound_s": bound, "rest_s": rest_s, "freed_s": freed_s,
         "decoded_late": decoded_late, "late": late,
         "reuse_s": max(starts) if starts and not late else None, "gauges": sorted(before), "told": told,
         "cuts": sorted({len(x.streamed.deltas) for x in cut if x.streamed is not None})}
    return m, found


def _watch_s(rest_s: float) -> float:
    """How long `abandon` watches /metrics after the disconnect: a quarter of the abandoned rest, at
    most a second."""
    return min(1.0, rest_s / 4)


def _watch(c: Any, before: Mapping[str, float], t_gone: float, window_s: float) -> tuple[float | None, float | None]:
    """Step 3 of `abandon`: /metrics polled from the last disconnect for `window_s`, or until the
    running gauges are back at their level `before`: when they were (`freed_s`, None if not), and the
    tokens the engine's per-step counter (DECODED_PER_STEP) counted over the window's second half,
    where it has one and that half was sampled over at least a quarter of the window (None if not).
    Nothing else runs meanwhile, so a count there is the abandoned streams' work going on (§4.9)."""
    counts: list[tuple[float, float]] = []
    while True:
        sample = read_metrics(c) or {}
        now, n = time.monotonic() - t_gone, decoded(sample)
        if before and all(running(sample).get(g, 0.0) <= v for g, v in before.items()):
            return now, None
        if n is not None and now >= window_s / 2:
            counts.append((now, n))
        if now >= window_s or (not before and n is None):
            break
        time.sleep(0.05)
    if len(counts) < 2 or counts[-1][0] - counts[0][0] < window_s / 4:
        return None, None
    return None, counts[-1][1] - counts[0][1]


def _abandon_note(m: Mapping[str, Any]) -> str:
    reuse = f"{m['reuse_s']:.2f} s" if m["reuse_s"] is not None else f"not within {m['bound_s']:g} s"
    freed = (f"; the running gauges ({', '.join(m['gauges'])}) were back to their level before {m['freed_s']:.2f} s "
             "after it" if m["freed_s"] is not None else
             f"; the running gauges ({', '.join(m['gauges'])}) had not fallen back within "
             f"{_watch_s(m['rest_s']):.2f} s" if m["gauges"] else "; no running gauge to watch")
    if m["decoded_late"] is not None:
        freed += (f"; its decode counter counted {m['decoded_late']:g} tokens in the second half of the "
                  f"{_watch_s(m['rest_s']):.2f} s after the disconnect")
    return (f"{m['slots']} long streams cut after {m['cuts']} deltas ({'; '.join(m['told'])}); the last of "
            f"{m['slots']} new streams started {reuse} after the last disconnect; the abandoned streams' rest "
            f"would have taken at least {m['rest_s']:.2f} s{freed}")


def disconnect_frees(a: LiveServer, case: Case) -> Outcome:
    """§4.10, §4.9: with the engine's concurrency limited to `slots`, `slots` streams abandoned at
    token `cut_at` and then `slots` new requests: all of them start within `bound_s` (a leaked place
    shows as queueing or a timeout), and a request in flight beside them is unaffected."""
    got = abandon(a, case)
    if isinstance(got, Outcome):
        return got
    m, found = got
    if m["late"]:
        found.append(finding("slot_leaked", f"new stream(s) {m['late']} of {m['slots']} did not start within "
                                            f"{m['bound_s']:g} s of the last disconnect: the abandoned places were "
                                            "not freed"))
    return _outcome(merge(found), [_abandon_note(m)], "disconnect_frees")


def _engine_said(m: Mapping[str, Any]) -> str:
    """What the engine's own metrics say of the abandoned work, from `_watch`: 'freed' (its running
    gauges back at their level before), 'decoding' (its per-step counter still counting late in the
    watch, a token or more per abandoned stream), else 'held' (gauges up) or 'none' (no gauge
    offered). A still counter says nothing alone: a stream parked on its full buffer (§4.8) decodes
    nothing and still holds its place, the request never aborted."""
    if m["freed_s"] is not None:
        return "freed"
    if m["decoded_late"] is not None and m["decoded_late"] >= m["slots"]:
        return "decoding"
    return "held" if m["gauges"] else "none"


def _timing_said(m: Mapping[str, Any]) -> str:
    """What the new streams' start says: 'stopped' (the places came back before half the abandoned
    streams' rest), 'unclear' (between half and 0.8 of it), 'ran_on' (later, or never)."""
    reuse, rest = m["reuse_s"], m["rest_s"]
    return "ran_on" if reuse is None or reuse >= 0.8 * rest else "unclear" if reuse >= 0.5 * rest else "stopped"


# §4.9's abort, judged from (the engine's word, timing): 'pass', a finding ('ran_on', 'decoded_on'),
# or what stays unchecked. The gauges and the decode counter are the engine's own word; the timing
# rests on an estimate of the rest from one stream alone, which varies between runs by far more than
# the margins above, so timing alone never fails the case (D72).
ABORT_EVIDENCE: Mapping[tuple[str, str], str] = {
    ("freed", "stopped"): "pass", ("freed", "unclear"): "pass", ("freed", "ran_on"): "pass",
    ("decoding", "stopped"): "decoded_on", ("decoding", "unclear"): "decoded_on", ("decoding", "ran_on"): "decoded_on",
    ("held", "ran_on"): "ran_on", ("held", "unclear"): "unclear", ("held", "stopped"): "gauges_held",
    ("none", "stopped"): "pass", ("none", "unclear"): "unclear", ("none", "ran_on"): "timing_only",
}


def _abort_unchecked(said: str, m: Mapping[str, Any]) -> str:
    """The not-checked line for an ABORT_EVIDENCE entry that decides nothing."""
    return {
        "unclear": f"whether the work stopped (the places came back after {m['reuse_s']:.2f} s, between half and "
                   f"the whole of the {m['rest_s']:.2f} s the rest would take)",
        "gauges_held": "the engine's gauges as evidence (they had not fallen back when the new streams were sent)",
        "timing_only": "whether the work stopped: only timing shows it (the new streams started "
                       + (f"{m['reuse_s']:.2f} s" if m["reuse_s"] is not None else "late")
                       + f" after the disconnect, the rest estimated at {m['rest_s']:.2f} s from one stream alone, "
                       "an estimate that varies between runs), and the engine offers no running gauge to confirm it",
    }[said]


def _abort_found(said: str, m: Mapping[str, Any]) -> str | None:
    """The `ran_on` finding's words for an ABORT_EVIDENCE entry that fails the case; None for one that
    does not."""
    why = {"ran_on": "the new streams waited until the abandoned ones could have run to their end, and the "
                     "running gauges stayed up",
           "decoded_on": "the engine's own decode counter went on counting after the disconnect, with nothing "
                         "else running"}.get(said)
    return None if why is None else f"{why} ({_abandon_note(m)}): the disconnect did not stop the work"


def judge_abort(m: Mapping[str, Any]) -> tuple[list[Finding], list[str]]:
    """§4.9 from `abandon`'s measures (ABORT_EVIDENCE, D72): a `ran_on` finding where the engine's
    decode counter went on counting after the disconnect, or where its gauges stayed up and the
    places came back as late as the rest would run; else what was not checked."""
    said = ABORT_EVIDENCE[_engine_said(m), _timing_said(m)]
    if said == "pass":
        return [], []
    if (words := _abort_found(said, m)) is not None:
        return [finding("ran_on", words)], []
    return [], [_abort_unchecked(said, m)]


def disconnect_abort(a: LiveServer, case: Case) -> Outcome:
    """§4.9: a stream abandoned at token `cut_at` stops being decoded (an abort, not a run to its end):
    the running gauges, where offered, fall back, and its place is taken again well before its rest
    would have run (`reuse_s` under half of `rest_s`); judged by `judge_abort`."""
    got = abandon(a, case)
    if isinstance(got, Outcome):
        return got
    m, found = got
    more, missed = judge_abort(m)
    return _outcome(merge(found + more), [_abandon_note(m)], "disconnect_abort", missed)


def resume(a: LiveServer, case: Case) -> Outcome:
    """§4.7 rules 3-4 (D5): every event of a stream carries an SSE id; a client cut after `cut_at`
    deltas that reconnects with Last-Event-ID gets exactly the rest (no event twice, none lost), one
    finish chunk and [DONE]; once the request has ended, the same resume replays the same rest."""
    k, timeout_s = int(case.inputs["cut_at"]), _timeout(case)
    want = long_text(a, case)
    with client(a.url, 2, timeout_s) as c:
        first = send(c, Job(LONG, PATH, long_body(a, case, stream=True), True, cut_after=k))
        a.log_exchanges([{**first.record(), "label": f"cut after {k} deltas"}])
        st = first.streamed
        if first.failed or st is None or first.status != 200:
            return Outcome(abort=f"the long stream did not open: status {first.status} {first.failed or ''}")
        if not st.sse_ids:
            return _outcome([finding("no_event_ids", f"the {len(st.chunks)} events before the cut carry no SSE id, "
                                                     "so a client cannot say where to resume")], [], "resume")
        rid = first.headers.get("x-request-id")
        if not rid:
            return _outcome([finding("no_resume", "the stream names no request to resume (no X-Request-Id header), "
                                                  f"though its events carry SSE ids ({st.sse_ids[:3]}...)")], [], "resume")
        found: list[Finding] = []
        last = st.sse_ids[-1]
        job = Job(LONG, f"/v1/requests/{rid}/events", {}, True, headers={"Last-Event-ID": last}, method="GET")
        rests = []
        for when in ("while it runs", "after it ended"):
            if when == "after it ended":
                _wait_done(c, rid)
            ex = send(c, job)
            a.log_exchanges([{**ex.record(), "label": f"resumed {when}, Last-Event-ID {last}"}])
            rests.append(ex)
            found += _resumed(ex, st, want, last, when)
    notes = [f"cut after {len(st.deltas)} deltas at SSE id {last} (X-Request-Id {rid}); resumed with Last-Event-ID "
             f"while it ran and after it ended: {[len(x.streamed.deltas) if x.streamed else 0 for x in rests]} deltas"]
    return _outcome(merge(found), notes, "resume")


def _wait_done(c: Any, rid: str) -> None:
    """Read the request's stream from its start to its end (it is then finished, and retained)."""
    send(c, Job(LONG, f"/v1/requests/{rid}/events", {}, True, method="GET"))


def _resumed(ex: Exchange, before: Any, want: str, last: str, when: str) -> list[Finding]:
    st = ex.streamed
    if ex.failed or st is None or ex.status != 200:
        return [finding("no_resume", f"resume {when} with Last-Event-ID {last} answered {ex.status} "
                                     f"{ex.failed or (st.error if st else '')}")]
    out = []
    got = before.text + st.text
    if got != want:
        out.append(finding("resume_mismatch", f"resumed {when}: the text before the cut plus the resumed text is "
                                              f"{text_difference(got, want)}"))
    ids = [n for n in map(sse_number, st.sse_ids) if n is not None]
    if sse_number(last) is not None and ids and min(ids) <= int(last):
        out.append(finding("resume_mismatch", f"resumed {when}: SSE ids {ids[:5]} repeat events up to {last}"))
    out += [finding(f.symptom, f"resumed {when}: {f.message}") for f in terminal_findings(st)]
    return out + [f for f in wire_findings(st) if f.symptom == "done_missing"]


RECIPES: Mapping[str, Callable[[LiveServer, Case], Outcome]] = {
    f.__name__: f for f in (batch_exact, terminal_under_load, preemption, disconnect_frees, disconnect_abort, resume)
}
