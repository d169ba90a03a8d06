"""One worker failing while the others serve: the gateway case (§4.7, §4.8).

A gateway in front of several workers meets a worker that dies mid-answer. `worker_failure` sends
`streams` long streams through the gateway at once (round robin spreads them over the workers), holds
each reader at its `cut_at`-th delta, makes one worker fail (`stopping`: the caller's way to kill or
stop one of its workers), then reads every stream to its end and sends `after` requests of the
recipe program. What must hold:

- a stream is whole (the long program's text, a finish chunk, [DONE]: it ran on a worker that kept
  serving, or the gateway sent it again elsewhere) or it ends as an error (a status other than 200,
  an error event, or a connection that drops before any terminal), its text so far the program's;
- never a 200 whose stream stops short and then ends with a finish chunk or [DONE], as if the text
  were whole (`cut_as_finished`: a transport failure is not an end of the answer);
- the streams on the workers that kept serving are unaffected: at least one ends whole
  (`healthy_cut` where none does), each whole one exactly the program's text (`batch_mismatch`).

The requests sent after the failure are notes (a router may keep routing to the dead worker until
its health check says otherwise). The case cannot run in a plain conform run (nothing there can stop
a worker): scripts/peers/failover.py runs it against a router's stack, tests/test_gateway.py against
decodespec serve workers behind tests/_gateway_kit.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..adapters.base import Finding, Outcome
from ..cases import Case, parse_case
from ..checkpoints import LONG, RECIPE
from ..http_script import PATH
from ..script_server import LiveServer, program_body
from ..symptoms import finding, merge, text_difference
from ..wire import Streamed
from .exchange import Exchange, Job, burst, client, send
from .recipes import _outcome, _timeout, long_body, long_text

CASE = parse_case({
    "id": "http/gateway/worker-failure/001",
    "anchor": "§4.7",
    "grade": "MUST",
    "invariant": "transport_not_eos",
    "diagram": "stream",
    "description": "Four long streams through a gateway in front of two workers; one worker fails after 8 deltas "
                   "of each: every stream is whole or ends as an error, none ends short with a finish chunk or "
                   "[DONE], and the streams on the worker that kept serving are whole.",
    "kind": "blackbox",
    "inputs": {"streams": 4, "cut_at": 8, "after": 4, "timeout_s": 120},
    "recipe": "worker_failure",
})

_STOP: list[Callable[[], str]] = []  # the caller's way to make one worker fail, while `stopping` holds it


@contextlib.contextmanager
def stopping(stop_one: Callable[[], str]) -> Iterator[None]:
    """Run `worker_failure` with `stop_one` (kills or stops one worker; returns what it did, for the
    notes) as its way to make a worker fail."""
    _STOP.append(stop_one)
    try:
        yield
    finally:
        _STOP.remove(stop_one)


def _ending(ex: Exchange) -> str:
    """How a stream ended: 'dropped' (its connection broke mid-body, or the read timed out),
    'error' (a status other than 200, an error event), 'finished' (a finish chunk or [DONE]) or
    'cut' (the body ended with neither)."""
    st = ex.streamed
    if ex.failed:
        return "dropped"
    if ex.status != 200 or st is None or st.error or st.error_events:
        return "error"
    return "finished" if st.finish_reasons or st.done else "cut"


def judge_streams(got: list[Exchange], want: str) -> tuple[list[Finding], dict[str, int]]:
    """The module's rules over the streams read through a worker's failure: the findings, and how
    many ended each way."""
    found: list[Finding] = []
    counts = {"whole": 0, "error": 0, "dropped": 0, "cut": 0, "short": 0}
    for i, ex in enumerate(got, 1):
        st = ex.streamed or Streamed()
        text, how = st.text, _ending(ex)
        if how == "finished" and text == want:
            counts["whole"] += 1
        elif how == "finished" and want.startswith(text):
            counts["short"] += 1
            found.append(finding("cut_as_finished", f"stream {i}: status 200, {len(text)} of the {len(want)} characters "
                                                    f"of the answer, then {st.finish_reasons or 'no'} finish "
                                                    f"reason{', [DONE]' if st.done else ''}: the worker's "
                                                    "failure passed off as the end of the answer"))
        elif not want.startswith(text) or how == "finished":
            found.append(finding("batch_mismatch", f"stream {i} ({how}): {text_difference(text, want)}"))
        else:
            counts[how] += 1
    if not counts["whole"]:
        found.append(finding("healthy_cut", f"none of the {len(got)} streams ended whole ({counts}): the streams on "
                                            "the workers that kept serving failed with the one that did not"))
    return merge(found), counts


def _kept(ex: Exchange, label: str) -> dict[str, Any]:
    """A stream's record for the report: a connection the failure broke is what the case looks for,
    not one that failed and was sent again (adapters.openai.retried_connections)."""
    return {**ex.record(), "label": label, **({"sent_again": False} if ex.failed else {})}


def worker_failure(a: LiveServer, case: Case) -> Outcome:
    """The gateway case (see module); n/a where no way to stop a worker is given (`stopping`)."""
    if not _STOP:
        return Outcome(skip="it needs a gateway in front of several workers and a way to make one fail "
                            "(scripts/peers/failover.py, life.failover.stopping)")
    n, k, after = int(case.inputs["streams"]), int(case.inputs["cut_at"]), int(case.inputs["after"])
    timeout_s, want = _timeout(case), long_text(a, case)
    job = Job(LONG, PATH, long_body(a, case, stream=True), True)
    arrived = threading.Semaphore(0)
    stopped = threading.Event()

    def reader(i: int) -> Exchange:
        held = [False]

        def at(count: int) -> None:
            if count >= k and not held[0]:
                held[0] = True
                arrived.release()
                stopped.wait(timeout_s)

        with client(a.url, 2, timeout_s) as c:
            ex = send(c, job, at)
        if not held[0]:
            arrived.release()
        return ex

    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(reader, i) for i in range(n)]
        for _ in range(n):
            arrived.acquire(timeout=timeout_s)
        t_stop = time.monotonic()
        did = _STOP[-1]()
        stopped.set()
        got = [f.result() for f in futures]
    took = time.monotonic() - t_stop
    recipe = a.checkpoint.programs[RECIPE]
    later = burst(a.url, [Job(RECIPE, PATH, program_body(a, recipe, len(recipe.script)), False)] * after,
                  timeout_s=timeout_s)
    found, counts = judge_streams(got, want)
    a.log_exchanges([_kept(ex, f"stream {i + 1} through the failure") for i, ex in enumerate(got)])
    served = sum(x.status == 200 and not x.failed for x in later)
    broke = sorted({ex.failed.split(":")[0] for ex in got if ex.failed})
    notes = [f"{n} long streams held at {k} deltas, then {did} ({took:.2f} s before the last stream ended): "
             f"{counts['whole']} whole, {counts['error']} ended as an error (a status or an error event), "
             f"{counts['dropped']} broken off {broke} (the connection dropped, or sent nothing until the client's read "
             f"timeout), {counts['cut']} closed without a terminal, {counts['short']} short and ended as if whole",
             f"{after} requests sent after the failure: {served} answered 200, the others "
             f"{sorted({x.failed or str(x.status) for x in later if x.status != 200 or x.failed})}"]
    missed = [] if counts["whole"] < len(got) else [
        "a stream broken off by the failing worker (every stream ended whole: the worker failed after its streams "
        "had ended, or the gateway sent them again)"]
    return _outcome(found, notes, "worker_failure", missed)
