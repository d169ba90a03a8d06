"""The batched Engine: continuous batching over the model protocol, a second driver of RequestRun.

Every request is a `RequestRun` (runtime/runner.py), the same object the single-path loop drives,
so the lifecycle, stop, detokenizer, stream and usage semantics are identical; this module only
decides *when* each run's phase methods are called. One `step()`:

1. Safe points of the waiting runs (§4.3 check_cancel_or_deadline before prefill): a queued or
   swapped-out request that was cancelled or passed its deadline ends without touching the model.
2. Admission, first come first served (no overtaking, so nothing starves): swapped-out runs and
   queued runs, in arrival order, while a batch slot is free and the cache budget has room for
   them plus one more token of every resident run. New runs are prefilled together
   (`prefill_batch`), swapped-out runs are resumed.
3. The decode step of §4.4: every resident DECODING run passes its safe point, then `select()`;
   the runs that need a decode form the active batch and one `decode_one` advances all of them
   (caches of different lengths). Runs that reached DRAINING or CANCEL_REQUESTED `end()`.

Backpressure (§4.8, DECISIONS D6): a `pause` run whose stream cannot take the next delta without
waiting is *parked*: it keeps its slot but is skipped (no select, no decode, no finish), so a slow
reader never blocks the batch; its safe points still run, so cancels and deadlines still land. A
parked run whose reader is disconnected fails with transport_error after `detach_timeout_s` (D5), and
one whose reader is connected but not reading after `stall_timeout_s` (a silent client cannot hold a
slot for ever; None: no bound).
`buffer` and `fail` streams never wait: past their cap the run fails inside `select()`.

Preemption (§4.8, last paragraph): when the resident caches plus one token per decoding run would
pass `cache_budget_tokens`, the latest-arrived resident run is preempted: `swap` copies its cache to
CPU (`snapshot()`) and frees the device tensors, `recompute` frees the cache and later re-prefills
prompt + processed outputs. The run keeps its StepState, pending logits and Sampler (RNG cursor).
Preemption is not a lifecycle transition; the trace records `sequence.preempted` /
`sequence.resumed`.

Exactness, precisely (§4.4, §4.8). Swap restores the cache bit for bit in every dtype. Whether a
run's tokens equal generate()'s (one sequence per kernel call) is a property of the kernels:
batching changes which kernel computes a row, and with bf16 weights the rounding then differs (on
the embedded model in bf16, 1 of 24 greedy outputs changed with batch composition); recompute
re-prefills the outputs in one call, which rounds differently from the token-by-token decodes it
replaces. In fp32 on CPU the tests find no difference (TinyLM, and transformers checkpoints, whose
HFModel batches the same way: one padded call a step, D50), but no kernel promises it. With
`batch_invariant=True` every prefill and decode runs one sequence at a time and recompute replays
the decodes token by token, so every run's tokens equal generate()'s bit for bit, in every dtype,
with swap or recompute, at the cost of batching's throughput (the batch-invariant-kernel remedy of
the deterministic-inference work, done here by never batching a kernel).

Kernel failures (§4.10): if a batched kernel raises, each sequence whose cache is unchanged is
retried alone, so only the sequence(s) whose kernel fails end FAILED with model_error; the others
go on undisturbed. A sequence whose cache was already written by the failed batch call fails too
(its K/V cannot be trusted twice).

Faults (§4.10, DECISIONS D20, D21): an exception raised by one request's own step (`select`: its
sampler on bad logits, its tokenizer, its content policy or grammar; its drain) ends that request
FAILED with model_error and an error naming the cause; the others go on (a model call's failure is
narrowed as above). An exception anywhere else (the Engine's own bookkeeping, a table refusing a
move) ends the engine: every live request gets its terminal event at once (model_error, or
cancelled for one still queued), `failure` says why, `submit` refuses with EngineFailed and the
cause is logged. `step_running_s` is the watchdog's gauge: how long the step now running has run
(a decode call that never returns shows here).

Threads: the phase methods are called from one driver thread (the engine thread of `start()`, or
the caller of `step()` / `run_until_idle()`). `submit`, `cancel`, `get` and `stats` may be called
from any thread. The engine thread runs the model's kernels on `threads` intra-op threads (DECISIONS
D60: one OpenMP team, the engine thread's; a server loads its model on one thread so that no
other team exists); with `pin_threads`, each thread of that team on a CPU of its own (D62).
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch

from ..machine import IllegalTransition, compiled_of, per_table
from ..machine.actions import Executor, fire_with_effects
from ..spec import FinishReason, Spec, Table, default_spec
from ..spec.derived import discovered_events, sequence_states
from .affinity import pin_team
from .errors import ModelError
from .events import EventKind
from .faults import FaultPlan
from .finish import FINISH_CHECKS
from .request import Request
from .runner import RequestRun, undecodable_mask
from .sampling import SamplingError, greedy_rows
from .wakes import batched_wakes


class Preemption(enum.StrEnum):
    """How a preempted run gives back its cache (§4.8)."""

    SWAP = "swap"
    RECOMPUTE = "recompute"


class EngineError(RuntimeError):
    """Base of the Engine's refusals."""


class QueueFull(EngineError):
    """`submit` found `max_queue` requests waiting; nothing was started (the server answers 429)."""


class EngineStopped(EngineError):
    """`submit` after `stop()` (the server answers 503)."""


class EngineFailed(EngineStopped):
    """`submit` after the engine itself failed (`Engine.failure`; the server answers 503)."""


class DuplicateRequest(EngineError):
    """A request id that is running or still retained was submitted again."""


class UnknownRequest(EngineError, LookupError):
    """No running or retained request has this id."""


@attrs.frozen
class EngineStats:
    """A snapshot of the Engine's counters (gauges go back to zero when it is idle)."""

    queue_depth: int
    active_slots: int
    parked: int
    parked_longest_s: float  # how long the longest-parked resident run has waited for its reader
    swapped: int
    cache_tokens_in_use: int
    cache_bytes_in_use: int
    swapped_bytes: int
    live_requests: int
    retained_requests: int
    requests_total: Mapping[tuple[str, str], int]
    preemptions_total: int
    resumes_total: int
    steps_total: int
    decode_tokens_total: int
    step_running_s: float = 0.0  # how long the step now running has run (the watchdog's gauge, D21)
    overlapped_steps_total: int = 0  # decode steps launched before their tokens' host work (D73)
    cancels_in_flight_total: int = 0  # cancels observed while such a step ran (§4.9, §4.11 B)


# The finish checks that hold for y_t before it is chosen (§4.3): a run they end is not launched ahead.
_KNOWN_ENDS = (FINISH_CHECKS["length"], FINISH_CHECKS["context_full"])
# Bytes one select() may send at most beyond the token's own bytes: a held partial UTF-8
# character and the stop matcher's held prefix (added per run to the longest stop).
_DELTA_SLACK = 64
_LOG = logging.getLogger("decodespec.engine")


@attrs.define(eq=False, slots=True)
class _Entry:
    """The Engine's bookkeeping for one live run (driver thread only, except `order`). Where the
    sequence is (queued, resident, parked, swapped, done) is `seq`, a stepper of
    spec/sequence.toml, moved only by Engine._move, which runs the row's effects (the lists
    below, kept by those effects, only order the entries of each state)."""

    run: RequestRun
    order: int
    headroom: int
    seq: Any  # a stepper of the Engine's sequence table
    snapshot: Any = None  # CacheSnapshot while swapped out
    detached_since: float | None = None
    parked_since: float | None = None  # when its reader last let it run (connected or not)
    # y_t chosen ahead by the batch's one argmax, valid while the run's logits are `chosen_from`
    chosen: int | None = None
    chosen_from: Any = None
    # overlap (D73): its stepper of spec/overlap.toml, the y_t its step in flight decodes, the cache
    # as its host work sees it meanwhile, and whether that step's decode.started is in the trace
    ov: Any = None
    ahead: int | None = None
    held: _HeldCache | None = None
    started: bool = False


@attrs.define(eq=False, slots=True)
class _HeldCache:
    """A run's cache as the host work on y_t sees it while the step decoding y_t runs (D73): its
    length before the step (the finish checks and the guard read that), and a free() deferred to the
    step's completion (wait_until_model_safe_point of §4.3: the step still writes the cache)."""

    cache: Any
    length: int
    free_asked: bool = False

    def free(self) -> None:
        self.free_asked = True

    def nbytes(self) -> int:
        return int(self.cache.nbytes())


class Engine:
    """Continuous batching with the semantics of `generate()` (§4.3, §4.4, §4.8, §4.9)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 64,
        max_queue: int = 1024,
        cache_budget_tokens: int | None = None,
        preemption: str | Preemption = "swap",
        detach_timeout_s: float = 30.0,
        stall_timeout_s: float | None = 60.0,
        retain_s: float = 60.0,
        max_retained: int = 1024,
        poll_s: float = 0.002,
        model_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        batch_invariant: bool = False,
        threads: int | None = None,
        pin_threads: bool = False,
        overlap: bool = False,
        spec: Spec | None = None,
        lifecycle: Table | None = None,
    ) -> None:
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("max_retained", max_retained),
                            ("threads", 1 if threads is None else threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if cache_budget_tokens is not None and (
            isinstance(cache_budget_tokens, bool) or not isinstance(cache_budget_tokens, int) or cache_budget_tokens < 1
        ):
            raise ValueError(f"cache_budget_tokens must be None or an int >= 1, got {cache_budget_tokens!r}")
        if stall_timeout_s is not None and (isinstance(stall_timeout_s, bool) or not isinstance(stall_timeout_s, (int, float))
                                            or stall_timeout_s < 0):
            raise ValueError(f"stall_timeout_s must be None or a number of seconds >= 0, got {stall_timeout_s!r}")
        for name, seconds in (("detach_timeout_s", detach_timeout_s), ("retain_s", retain_s), ("poll_s", poll_s)):
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {seconds!r}")
        try:
            self.preemption = Preemption(preemption)
        except ValueError:
            raise ValueError(f"preemption must be 'swap' or 'recompute', got {preemption!r}") from None
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name or str(getattr(model, "name", type(model).__name__))
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.cache_budget_tokens = cache_budget_tokens
        self.detach_timeout_s = float(detach_timeout_s)
        self.stall_timeout_s = None if stall_timeout_s is None else float(stall_timeout_s)
        self.retain_s = float(retain_s)
        self.max_retained = max_retained
        self.poll_s = float(poll_s)
        self.threads = threads  # the engine thread's intra-op threads; None: the starting thread's (D60)
        self.pin_threads = pin_threads  # each of them on a CPU of its own (D62)
        self.pinned: tuple[int, ...] = ()  # the CPUs they were pinned to, once the engine thread runs
        self.clock = clock
        # the tables its requests follow (default: the spec directory's); `lifecycle` in place of the spec's
        spec = spec or default_spec()
        self.spec = spec = spec.replace(lifecycle) if lifecycle is not None else spec
        self._sequence, self._seq_plans = compiled_of(spec["sequence"]), _seq_plans_of(spec["sequence"])
        # where a sequence is held back by its reader, and where it is swapped out (sequence.toml's rows)
        where = sequence_states(spec["sequence"])
        self._parked_states = frozenset(self._sequence.State[s] for s in where.parked)
        self._swapped_states = frozenset(self._sequence.State[s] for s in where.swapped)
        self._budget = math.inf if cache_budget_tokens is None else cache_budget_tokens
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
        self.batch_invariant = batch_invariant
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        # overlap (D73): each decode runs on the forward thread while the driver does its tokens' host work
        self.overlap = overlap
        self._overlap = compiled_of(spec["overlap"]) if overlap else None
        self._ov_plans = _ov_plans_of(spec["overlap"]) if overlap else {}
        self._discovered = discovered_events(spec["overlap"]) if overlap else {}
        self._forward: concurrent.futures.ThreadPoolExecutor | None = None
        self._overlapped = self._in_flight_cancels = 0
        self._batched_prefill = callable(getattr(model, "prefill_batch", None)) and not batch_invariant
        self._lock = threading.Lock()
        self._order = itertools.count()
        self._queue: collections.deque[_Entry] = collections.deque()
        self._live: dict[str, _Entry] = {}
        self._retained: collections.OrderedDict[str, tuple[RequestRun, float]] = collections.OrderedDict()
        self._resident: list[_Entry] = []  # on the device, in arrival order (driver only)
        self._swapped: list[_Entry] = []  # preempted, in arrival order (driver only)
        self._requests_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self._preemptions = self._resumes = self._steps = self._decoded = 0
        self._stopped = False
        self._wake = threading.Event()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._step_since: float | None = None  # when the step now running began (the watchdog)
        self.failure: BaseException | None = None  # an unexpected error that ended the engine (D21)

    # ---- the client side (any thread) ----------------------------------------------------

    @property
    def context_limit(self) -> int:
        return self.model.context_limit

    def submit(self, request: Request, faults: FaultPlan | None = None) -> RequestRun:
        """Admit `request` (CREATED -> QUEUED, or its refusal, DECISIONS D9) and return its run.

        Raises QueueFull when `max_queue` requests wait, EngineStopped after `stop()`,
        DuplicateRequest for an id still known; in those cases nothing is created.
        """
        if not isinstance(request, Request):
            raise TypeError(f"submit() takes a Request, got {type(request).__name__}")
        rid = request.request_id
        with self._lock:
            if self.failure is not None:
                raise EngineFailed(f"the engine failed ({type(self.failure).__name__}: {self.failure}) and "
                                   "takes no new requests")
            if self._stopped:
                raise EngineStopped("the engine is stopped and takes no new requests")
            if rid in self._live or rid in self._retained:
                raise DuplicateRequest(f"request id {rid!r} is already in use")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the queue is full: {len(self._queue)} requests waiting (max_queue={self.max_queue})")
            run = RequestRun(
                request, model=self.model, tokenizer=self.tokenizer, faults=faults,
                model_name=self.model_name, clock=self.clock, pause_timeout_s=self.detach_timeout_s,
                spec=self.spec,
            )
            if run.admit():
                stops = max((len(s.encode()) for s in request.stop), default=0)
                entry = _Entry(run, next(self._order), headroom=stops + _DELTA_SLACK, seq=self._sequence.new(),
                               ov=None if self._overlap is None else self._overlap.new())
                self._queue.append(entry)
                self._live[rid] = entry
            else:
                run.end()
                self._record_done(run)
        self._wake.set()
        return run

    def cancel(self, request_id: str, source: str = "client") -> bool:
        """Request a cancel (§4.9); True when the request was still running (it ends at its
        next safe point), False when it had already ended. UnknownRequest otherwise."""
        with self._lock:
            entry = self._live.get(request_id)
            if entry is None:
                if request_id in self._retained:
                    return False
                raise UnknownRequest(f"no request with id {request_id!r}")
        entry.run.cancel(source)
        self._wake.set()
        return True

    def get(self, request_id: str) -> RequestRun:
        """The run of a live or retained request (for replay, §4.7 rule 4)."""
        with self._lock:
            entry = self._live.get(request_id)
            if entry is not None:
                return entry.run
            kept = self._retained.get(request_id)
        if kept is None:
            raise UnknownRequest(f"no request with id {request_id!r} (never submitted, or no longer retained)")
        return kept[0]

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._live

    def stats(self) -> EngineStats:
        now = self.clock()
        with self._lock:
            resident, swapped = list(self._resident), list(self._swapped)
            caches = [e.run.cache for e in resident if e.run.cache is not None]
            return EngineStats(
                queue_depth=len(self._queue),
                active_slots=len(resident),
                parked=sum(1 for e in resident if self._blocked(e)),
                parked_longest_s=max((now - e.parked_since for e in resident if e.parked_since is not None),
                                     default=0.0),
                swapped=len(swapped),
                cache_tokens_in_use=sum(c.length for c in caches),
                cache_bytes_in_use=sum(c.nbytes() for c in caches),
                swapped_bytes=sum(_snapshot_bytes(e.snapshot) for e in swapped),
                live_requests=len(self._live),
                retained_requests=len(self._retained),
                requests_total=dict(self._requests_total),
                preemptions_total=self._preemptions,
                resumes_total=self._resumes,
                steps_total=self._steps,
                decode_tokens_total=self._decoded,
                step_running_s=self.step_running_s,
                overlapped_steps_total=self._overlapped,
                cancels_in_flight_total=self._in_flight_cancels,
            )

    @property
    def step_running_s(self) -> float:
        """Seconds the step now running has taken so far, 0 between steps (the watchdog, D21)."""
        since = self._step_since
        return 0.0 if since is None else max(0.0, self.clock() - since)

    # ---- the driver ----------------------------------------------------------------------

    def step(self) -> bool:
        """One scheduler iteration (module doc). True when anything moved."""
        now = self._step_since = self.clock()
        moved = self._waiting_safe_points()
        moved = self._admit() or moved
        moved = self._decode_step(now) or moved
        self._expire(now)
        self._steps += 1
        self._step_since = None
        return moved

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Step until no request is live, or until a step moves nothing (every live run is parked
        on its reader). Returns the number of steps taken."""
        for n in range(1, max_steps + 1):
            if not self.step() or self.idle:
                return n
        raise EngineError(f"run_until_idle: still busy after {max_steps} steps")

    def start(self) -> None:
        """Run `step()` on a background thread until `stop()`, its kernels on `threads` intra-op
        threads (None: as many as the calling thread has now)."""
        if self._thread is not None:
            raise EngineError("the engine thread is already started")
        threads = self.threads or torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, args=(threads,), name="decodespec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking requests, end the engine thread, and end every live request: cancelled
        (§4.9) where a cancel applies; a DRAINING run finishes, or fails with transport_error when
        its reader is too slow to take the rest (D2: DRAINING ignores a cancel)."""
        with self._lock:
            self._stopped = True
        self._halt.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise EngineError(f"the engine thread did not stop within {timeout} s")
        self._end_all(None)
        if self._forward is not None:
            self._forward.shutdown(wait=True)
            self._forward = None

    def _end_all(self, failure: str | None) -> None:
        """End every live request now. `failure` None (stop): cancelled where a cancel applies,
        a DRAINING run finishes or fails on its slow reader (D2). Otherwise the engine failed
        (D21): every run with model work FAILED with model_error and `failure` as its error, a
        queued one cancelled (nothing of it started). One run that cannot be ended is logged and
        its stream still gets a terminal event; the others are ended all the same."""
        with self._lock:
            entries = list(self._live.values())
        for e in entries:
            e.run.cancel("shutdown" if failure is None else "engine_failed")
        for e in entries:
            run = e.run
            where = run.driver_states
            try:
                if failure is not None and run.state in where.model_work:
                    run.kernel_failed(ModelError(failure))
                if run.state in where.safe_point:  # the cancel (or a deadline) is observed
                    run.check_point()
                if run.state in where.draining and self._blocked(e):
                    run.transport_failed("the engine stopped before the reader took the rest")
                run.end()
                self._drop(e)
            except Exception:  # the engine is going down: this run's stream still ends
                _LOG.exception("request %s could not be ended in order", run.request.request_id)
                if not run.stream.closed:
                    run.stream.fail(FinishReason.MODEL_ERROR, run.usage().as_dict(),
                                    f"model_error: {failure or 'the engine stopped'}")
                with self._lock:
                    self._live.pop(run.request.request_id, None)
        with self._lock:
            self._queue.clear()
        self._resident.clear()
        self._swapped.clear()

    def _loop(self, threads: int) -> None:
        # OpenMP's thread count is per thread: this one's kernels get theirs here, whatever the
        # count torch gives a new thread (D60).
        torch.set_num_threads(threads)
        if self.pin_threads:
            self.pinned = pin_team(threads)
            _LOG.info("engine thread and its OpenMP workers pinned to CPUs %s", self.pinned or (
                "(none: one thread, fewer CPUs than threads, no /proc, or a team not exactly threads - 1 new "
                "threads; D62 pins nothing on a guess)"))
        try:
            while not self._halt.is_set():
                self._wake.clear()
                with batched_wakes():  # the step's readers woken once, at its end (D57)
                    moved = self.step()
                if not moved:
                    self._wake.wait(self.poll_s if not self.idle else 0.1)
        except BaseException as exc:  # the engine cannot go on: every request ends now (D21)
            self._step_since = None
            self.failure = exc
            _LOG.critical("the engine failed: %s: %s; every live request ends", type(exc).__name__, exc, exc_info=exc)
            with self._lock:
                self._stopped = True
            self._end_all(f"the engine failed: {type(exc).__name__}: {exc}")

    def _crashed(self, e: _Entry, exc: Exception, where: str) -> None:
        """One request's own step raised: that request alone fails (D20); the caller settles it.

        A table's refusal (IllegalTransition) is no request's fault but the runtime's own protocol
        error: it goes on up, where the engine ends every request (D21) or the library caller sees it."""
        if isinstance(exc, IllegalTransition):
            raise exc
        _LOG.warning("request %s: %s raised %s: %s; it ends FAILED", e.run.request.request_id, where,
                     type(exc).__name__, exc)
        e.run.crashed(exc, where)

    # ---- phase 1: safe points of queued and swapped-out runs -----------------------------

    def _waiting_safe_points(self) -> bool:
        """check_cancel_or_deadline (§4.3) for runs that are not resident."""
        with self._lock:
            queued = list(self._queue)
        moved = False
        for e in queued:
            if not e.run.check_point():
                self._settle(e)
                moved = True
        for e in list(self._swapped):
            if e.run.decoding:
                if e.run.check_point():
                    continue
                moved = True  # a cancel or a deadline observed while swapped out
            if self._settle(e):
                moved = True
            elif len(self._resident) < self.max_batch:
                # DRAINING with a full stream: it needs no cache, only its reader, but resuming takes
                # a place in the batch (sequence.toml): without a free one it waits swapped.
                self._move(e, "resume")  # restore_cache restores nothing for a draining run
                moved = True
        if moved:
            with self._lock:
                self._queue = collections.deque(e for e in self._queue if not e.run.done)
        return moved

    # ---- phase 2: admission, prefill and resume ------------------------------------------

    def _admit(self) -> bool:
        with self._lock:
            if not self._queue and not self._swapped:
                return False
            waiting = sorted(itertools.chain(self._swapped, self._queue), key=lambda e: e.order)
        in_use = sum(e.run.cache.length for e in self._resident)
        slots = self.max_batch - len(self._resident)
        growth = len(self._resident)
        chosen: list[_Entry] = []
        for e in waiting:
            need = self._need(e)
            busy = self._resident or chosen
            if slots <= 0 or (busy and in_use + need + growth > self._budget):
                break
            chosen.append(e)
            in_use += need
            growth += 1
            slots -= 1
        if not chosen:
            return False
        fresh = [e for e in chosen if not self._swapped_out(e)]
        if fresh:
            with self._lock:
                taken = set(map(id, fresh))
                self._queue = collections.deque(e for e in self._queue if id(e) not in taken)
            self._prefill(fresh)
        for e in chosen:
            if self._swapped_out(e):
                self._resume(e)
        self._resident.sort(key=lambda e: e.order)
        return True

    def _swapped_out(self, e: _Entry) -> bool:
        return e.seq.state in self._swapped_states

    def _need(self, e: _Entry) -> int:
        """Cache tokens the run will hold once resident, plus its next decode."""
        run = e.run
        if self._swapped_out(e):
            return len(run.prompt_ids) + run.decoded + 1
        return len(run.prompt_ids) + 1

    def _prefill(self, entries: list[_Entry]) -> None:
        """QUEUED -> PREFILLING -> DECODING for `entries`, one batched prefill kernel (§4.3)."""
        for e in entries:  # into the batch; prefill.started and the in-flight cancel check, per run
            self._move(e, "admit")
            e.run.begin_prefill()
        prompts = [e.run.prompt_ids for e in entries]
        try:
            if self._batched_prefill and len(entries) > 1:
                logits, caches = self.model.prefill_batch(prompts)
                results: list[Any] = list(zip(logits, caches))
            else:
                results = [self.model.prefill(p) for p in prompts]
        except Exception as exc:
            results = [self._prefill_alone(p) for p in prompts] if len(entries) > 1 else [exc]
        for e, out in zip(entries, results):
            run = e.run
            if run.take_kernel_fault():
                if not isinstance(out, Exception):
                    out[1].free()
                out = ModelError("injected model error")
            if isinstance(out, Exception):
                run.kernel_failed(ModelError(f"{type(out).__name__}: {out}"))
            else:
                run.end_prefill(*out)
            if not run.decoding:
                self._settle(e)

    def _prefill_alone(self, prompt: list[int]) -> Any:
        try:
            return self.model.prefill(prompt)
        except Exception as exc:
            return exc

    def _resume(self, e: _Entry) -> None:
        self._move(e, "resume")  # take_place, restore_cache
        if e.run.done:  # the restore failed: FAILED with model_error
            self._drop(e)

    def _preempt(self, e: _Entry) -> None:
        self._move(e, "preempt")  # give_place, snapshot_cache

    def _move(self, e: _Entry, event: str) -> None:
        """Move the sequence along spec/sequence.toml: fire `event` and run its row's effects (the
        Engine's SEQUENCE executor below); a move the table refuses changes nothing."""
        fire_with_effects(e.seq, self._seq_plans, event, self, e)

    # ---- phase 3: the decode step (§4.4) -------------------------------------------------

    def _decode_step(self, now: float) -> bool:
        if not self._resident:
            return False
        moved = False
        ready: list[_Entry] = []
        for e in list(self._resident):
            run = e.run
            decoding = run.decoding
            if decoding and run.check_point():
                if not run.stream.would_wait(e.headroom):  # the common case (_blocked): to select
                    if e.seq.state in self._parked_states:
                        self._move(e, "unpark")
                    ready.append(e)
                    continue
            elif decoding:
                moved = True
            if self._blocked(e):
                moved = self._parked(e, now) or moved
            elif run.decoding:
                if e.seq.state in self._parked_states:
                    self._move(e, "unpark")
                ready.append(e)
            moved = self._settle(e) or moved
        ready = self._fit_budget(ready)
        if self._overlap is not None:
            self._overlapped_step(ready)
        else:
            self._select_and_decode(ready)
        return moved or bool(ready)

    def _select_and_decode(self, ready: list[_Entry]) -> None:
        """y_t and its host work for every ready run, then one decode of those that go on (§4.3, §4.4)."""
        active: list[_Entry] = []
        for e in ready:
            run = e.run
            token = e.chosen if e.chosen_from is run.logits else None
            e.chosen_from = None
            if self._select(e, token):
                active.append(e)
            else:
                self._settle(e)
        if active:
            self._decode(active)

    def _select(self, e: _Entry, token: int | None) -> bool:
        """The run's select() (y_t and its host work, §4.3); a failure of its own is its end (D20)."""
        run = e.run
        try:
            return run.select(token)
        except SamplingError as exc:  # the model's logits cannot be sampled (NaN, +inf): its error
            run.kernel_failed(ModelError(f"bad logits: {exc}"))
        except Exception as exc:  # its tokenizer, content policy or grammar raised (D20)
            self._crashed(e, exc, "selecting a token")
        return False

    # ---- the overlapped step (D73, spec/overlap.toml) ------------------------------------

    def _overlapped_step(self, ready: list[_Entry]) -> None:
        """The decode step with y_t's decode launched before y_t's host work (§4.3, §4.9, §4.11):
        each greedy run's y_t is the argmax of its logits, its decode runs on the forward thread
        while select() detokenizes, matches and streams y_t; the runs whose host work ended them
        (or observed a cancel or a deadline) have the result discarded, the others take it. A run
        whose y_t is drawn by its sampler or restricted by its UTF-8 guard is not launched ahead:
        it is decoded after the join, as without overlap."""
        launched = [(e, token) for e in ready if (token := self._ahead(e)) is not None]
        if not launched:  # nothing to overlap: the step as without overlap
            self._select_and_decode(ready)
            return
        caches = [e.run.cache for e, _ in launched]
        tokens = [token for _, token in launched]
        for e, token in launched:
            e.ahead, e.started = token, False
            self._ov(e, "launch")  # start_step: the host work sees the cache as it was before the step
        for e in ready:  # the model may touch any resident cache while it runs: none is freed meanwhile
            if e.held is None:
                _hold(e)
        future = self._forward_pool().submit(self._forward_batch, caches, tokens)
        self._overlapped += 1
        later: list[_Entry] = []
        ended: list[_Entry] = []
        try:
            for e in ready:
                needs_decode = self._select(e, e.ahead)
                if e.ahead is not None:
                    self._host_done(e, needs_decode)
                elif needs_decode:  # not launched: decoded after the join, as without overlap
                    later.append(e)
                else:
                    ended.append(e)
        finally:
            self._join(future, launched, ready)
        for e in ended:
            self._settle(e)
        if later:
            self._decode(later)

    def _ahead(self, e: _Entry) -> int | None:
        """y_t chosen before its host work exactly as select() will choose it: the greedy choice of
        the run's logits (the batch's argmax of the last step where there was one), ids the
        tokenizer cannot decode left out (D20). None for a run whose sampler draws (its RNG is
        drawn once, by select), whose UTF-8 guard restricts the choice by the bytes held (D16), or
        whose loop is known to end at y_t (its length, its context: a step decoding y_t would only
        be discarded)."""
        run = e.run
        chosen, e.chosen_from = (e.chosen if e.chosen_from is run.logits else None), None
        if not run.sampler.greedy or run.guard is not None or any(
                check(run, False, b"", None, len(run.tokens) + 1, None) for check in _KNOWN_ENDS):
            return None
        mask = undecodable_mask(self.tokenizer, self.model.vocab_size, getattr(self.model, "device", "cpu"))
        if mask is not None:
            return greedy_rows(run.step_logits.masked_fill(mask, float("-inf"))[None], [run.sampler])[0]
        return chosen if chosen is not None else greedy_rows(run.step_logits[None], [run.sampler])[0]

    def _host_done(self, e: _Entry, needs_decode: bool) -> None:
        """Fire on the run's step in flight what y_t's host work found: it went on (then the check
        point of §4.3 and decode.started, a cancel observed there discards), or it ended."""
        run = e.run
        if not needs_decode:
            self._ov(e, self._ended(run))  # a stop, an EOS, the length, ...: the result is discarded
            return
        if run.tokens[-1] != e.ahead:  # _ahead chose as select() does: the step decoded y_t or nothing is sure
            raise EngineError(f"request {run.request.request_id}: the step launched decodes {e.ahead}, "
                              f"select() chose {run.tokens[-1]}")
        self._ov(e, "go_on")
        where = run.driver_states
        if not run.check_point():  # the check point of §4.3, while the step runs
            self._in_flight_cancels += run.state in where.cancel_observed
            self._ov(e, self._ended(run))
            return
        run.begin_decode()  # decode.started (its faults delivered); a cancel arrived by now is observed
        e.started = True
        if run.state in where.cancel_observed:
            self._in_flight_cancels += 1
            self._ov(e, "cancel")

    def _ended(self, run: RequestRun) -> str:
        """The overlap table's event for how the run's loop ended ([discovered], by finish reason)."""
        if run.state in run.driver_states.cancel_observed:
            return self._discovered[FinishReason.CANCELLED]
        reason = run.reason
        if reason is None:
            raise EngineError(f"request {run.request.request_id}: the loop ended in {run.state} with no reason")
        return self._discovered[reason]

    def _forward_batch(self, caches: list[Any], tokens: list[int]) -> Any:
        """On the forward thread: one decode_one over the batch (one call a sequence when batch-invariant)."""
        if self.batch_invariant:
            return [self._decode_single(c, t) for c, t in zip(caches, tokens)]
        return self.model.decode_one(caches, tokens)

    def _forward_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._forward is None:  # its OpenMP team as large as the engine thread's (D60)
            self._forward = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="decodespec-forward", initializer=torch.set_num_threads,
                initargs=(self.threads or torch.get_num_threads(),))
        return self._forward

    def _join(self, future: concurrent.futures.Future, launched: list[tuple[_Entry, int]], ready: list[_Entry]) -> None:
        """Wait for the step, give each ready run its cache back (a free asked meanwhile done now,
        once), then `complete`: take or discard each launched run's row (the table's row says which)."""
        entries = [e for e, _ in launched]
        rows: list[Any]
        picks: list[int | None] = [None] * len(entries)
        self._await(future, entries)
        try:
            out = future.result()
        except Exception as exc:
            out = exc
        held = [e.held for e in entries]
        for e in ready:
            h = e.held
            if h is not None:
                e.run.cache, e.held = h.cache, None
                if h.free_asked:
                    h.cache.free()
        if isinstance(out, Exception):
            rows = [self._decode_alone(h.cache, t, h.length, out, len(entries)) if h is not None and e.run.decoding
                    else out for e, h, (_, t) in zip(entries, held, launched)]
        elif isinstance(out, torch.Tensor):
            rows, picks = list(out.unbind(0)), greedy_rows(out, [e.run.sampler for e in entries])
        else:
            rows = list(out)
        for e, row, pick in zip(entries, rows, picks):
            self._ov(e, "complete", row, pick)
            e.ahead, e.started = None, False
            if not e.run.decoding:
                self._settle(e)

    def _await(self, future: concurrent.futures.Future, entries: list[_Entry]) -> None:
        """While the step runs, the check point of every run that goes on is passed again whenever
        the Engine is woken (a cancel wakes it) and at the nearest deadline: a cancel or a deadline
        that arrives now is observed while the step runs, and its result discarded (§4.11 B)."""
        going = [e for e in entries if e.started]
        if not going:
            return
        wake = self._wake
        future.add_done_callback(lambda _: wake.set())
        while not future.done():
            deadlines = [e.run.deadline_at for e in going if e.run.deadline_at is not None]
            wake.wait(None if not deadlines else min(1.0, max(0.0, min(deadlines) - self.clock())))
            wake.clear()  # a cancel's flag is set before its wake: the check points below see it
            for e in going:
                if e.run.decoding and not e.run.check_point():
                    self._in_flight_cancels += e.run.state in e.run.driver_states.cancel_observed
                    self._ov(e, self._ended(e.run))
            going = [e for e in going if e.run.decoding]
            if not going:
                return

    def _ov(self, e: _Entry, event: str, row: Any = None, pick: int | None = None) -> None:
        """Fire `event` on the run's overlap stepper and run its row's effects (OVERLAP below)."""
        fire_with_effects(e.ov, self._ov_plans, event, self, e, row, pick)

    def _settle(self, e: _Entry) -> bool:
        """end() a run that reached the end of its loop and can send its tail; True when it
        is done (and dropped). A DRAINING run whose reader is behind waits (§4.8)."""
        run = e.run
        where = run.driver_states
        if run.state in where.cancel_observed:
            run.end()
        elif run.state in where.draining and not self._blocked(e):
            try:
                run.end()
            except Exception as exc:  # its tail's checks raised (a content policy on the flush, D20)
                self._crashed(e, exc, "sending its tail")
        if run.done:
            self._drop(e)
            return True
        return False

    def _parked(self, e: _Entry, now: float) -> bool:
        """A run held back by its slow reader (§4.8); True when it was failed: its reader detached for
        `detach_timeout_s` (D5), or connected but not reading for `stall_timeout_s` (D5)."""
        run = e.run
        if run.done:
            if e.seq.state in self._parked_states:
                self._move(e, "unpark")
            return False
        if e.seq.state not in self._parked_states:
            self._move(e, "park")
        if run.stream.connected:
            e.detached_since = None
            since, limit, what = e.parked_since, self.stall_timeout_s, "stall_timeout"
            why = f"reader connected but not reading for {limit} s (the stream paused)"
        else:
            if e.detached_since is None:
                e.detached_since = now
            since, limit, what = e.detached_since, self.detach_timeout_s, "detach_timeout"
            why = f"reader detached and the stream paused for {limit} s"
        if limit is None or since is None or now - since < limit or run.state not in run.driver_states.transport:
            return False
        run.transport_failed(why, what)
        return True

    def _fit_budget(self, ready: list[_Entry]) -> list[_Entry]:
        """Preempt the latest arrivals until every ready run can write one more token (§4.8)."""
        if self._budget == math.inf or not ready:
            return ready
        in_use = sum(e.run.cache.length for e in self._resident)
        decoding = [e for e in self._resident if e.run.decoding]
        while len(decoding) > 1 and in_use + len(ready) > self._budget:
            victim = decoding.pop()  # never the earliest: it always makes progress
            in_use -= victim.run.cache.length
            self._preempt(victim)
            if victim in ready:
                ready.remove(victim)
        return ready

    def _decode(self, active: list[_Entry]) -> None:
        """One decode_one over the active batch; a failure is narrowed to its sequence(s)."""
        runs = [e.run for e in active]
        caches, tokens, lengths = [], [], []
        for run in runs:  # one pass: decode.started and the in-flight cancel check, per run
            run.begin_decode()
            cache = run.cache
            caches.append(cache)
            tokens.append(run.tokens[-1])
            lengths.append(cache.length)
        picks: list[int | None] = [None] * len(runs)
        if self.batch_invariant:  # one sequence per kernel call: rows never depend on the batch
            rows: Any = [self._decode_single(c, t) for c, t in zip(caches, tokens)]
        else:
            try:
                out = self.model.decode_one(caches, tokens)
            except Exception as exc:
                rows = [self._decode_alone(c, t, n, exc, len(runs)) for c, t, n in zip(caches, tokens, lengths)]
            else:
                if isinstance(out, torch.Tensor):  # greedy rows: one argmax for the batch (§4.4)
                    rows, picks = out.unbind(0), greedy_rows(out, [run.sampler for run in runs])
                else:
                    rows = list(out)
        for e, run, row, pick in zip(active, runs, rows, picks):
            self._took(e, row, pick)
            if not run.decoding:
                self._settle(e)

    def _took(self, e: _Entry, row: Any, pick: int | None) -> None:
        """A decode's row for the run: its logits (decode.completed; the lifecycle's row decides
        whether they are kept), or the kernel's failure, an injected one first (§4.10)."""
        run = e.run
        if run.take_kernel_fault():
            row = ModelError("injected model error")
        if isinstance(row, Exception):
            run.kernel_failed(row if isinstance(row, ModelError) else ModelError(f"{type(row).__name__}: {row}"))
        else:
            run.end_decode(row)
            self._decoded += 1
            if pick is not None:
                e.chosen, e.chosen_from = pick, row

    def _decode_alone(self, cache: Any, token: int, length: int, batch_exc: Exception, size: int) -> Any:
        """After a batched decode raised: this sequence alone, unless its cache was already written."""
        if size == 1 or cache.length != length:
            return batch_exc
        return self._decode_single(cache, token)

    def _decode_single(self, cache: Any, token: int) -> Any:
        try:
            return self.model.decode_one([cache], [token])[0]
        except Exception as exc:
            return exc

    # ---- bookkeeping ---------------------------------------------------------------------

    def _blocked(self, e: _Entry) -> bool:
        """Would the next send of this pause-policy run wait for its reader (§4.8)?"""
        run = e.run
        return not run.done and run.stream.would_wait(e.headroom)

    def _drop(self, e: _Entry) -> None:
        """Forget a run that reached its terminal state; keep it for replay (retain_s). The
        `drop` row: a second drop is an IllegalTransition, never a second release."""
        self._move(e, "drop")  # leave_batch (give_place, forget) or forget
        if e.ov is not None:
            self._ov(e, "release")  # the overlap table refuses it while a step of the run is in flight

    def _record_done(self, run: RequestRun) -> None:
        """Called with the lock held."""
        reason = run.reason.value if run.reason is not None else ""
        self._requests_total[(run.state, reason)] += 1
        self._retained[run.request.request_id] = (run, self.clock())
        while len(self._retained) > self.max_retained:
            self._retained.popitem(last=False)

    def _expire(self, now: float) -> None:
        with self._lock:
            while self._retained:
                rid, (_, t) = next(iter(self._retained.items()))
                if now - t < self.retain_s:
                    break
                del self._retained[rid]

    def runs(self) -> Iterable[RequestRun]:
        """Every live and retained run (a snapshot)."""
        with self._lock:
            return [e.run for e in self._live.values()] + [r for r, _ in self._retained.values()]


def _snapshot_bytes(snap: Any) -> int:
    if snap is None:
        return 0
    k = getattr(snap, "k", None)
    if k is None:
        return 0
    return k.numel() * k.element_size() * 2


# ---- the Engine's implementation of every sequence effect (machine/actions.py) ---------------
# Each runs as (engine, entry); Engine._move runs them by phase when a sequence row fires.
SEQUENCE = Executor("sequence", "the runtime (engine.Engine)")


@SEQUENCE.effect("take_place")
def _take_place(eng: Engine, e: _Entry) -> None:
    eng._resident.append(e)
    eng._resident.sort(key=lambda x: x.order)


@SEQUENCE.effect("give_place")
def _give_place(eng: Engine, e: _Entry) -> None:
    eng._resident.remove(e)


@SEQUENCE.effect("snapshot_cache")
def _snapshot_cache(eng: Engine, e: _Entry) -> None:
    """Swap: the cache is copied out, then freed; recompute: freed (§4.8)."""
    run = e.run
    cache_len = run.cache.length
    if eng.preemption is Preemption.SWAP:
        e.snapshot = run.cache.snapshot()
    run.cache.free()
    e.detached_since = e.parked_since = None  # its reader's timers start again once it is back
    eng._swapped.append(e)
    eng._swapped.sort(key=lambda x: x.order)
    eng._preemptions += 1
    run.trace.emit(EventKind.PREEMPTED, mode=eng.preemption.value, cache_len=cache_len)


@SEQUENCE.effect("restore_cache")
def _restore_cache(eng: Engine, e: _Entry) -> None:
    """The cache comes back (swap: copied in; recompute: prefilled again, or replayed one decode at
    a time when batch-invariant); a draining run needs none. A failure is the run's model_error."""
    eng._swapped.remove(e)
    run, snapshot = e.run, e.snapshot
    e.snapshot = None
    if not run.decoding:
        return
    try:
        if eng.preemption is Preemption.SWAP:
            run.cache.restore(snapshot)
        elif eng.batch_invariant:  # the same kernel calls as the first time: the same bits
            _, cache = eng.model.prefill(run.prompt_ids)
            for token in run.tokens[: run.decoded]:
                eng.model.decode_one([cache], [token])
            run.cache = cache
        else:
            _, cache = eng.model.prefill(run.prompt_ids + run.tokens[: run.decoded])
            cache.prompt_length = len(run.prompt_ids)
            run.cache = cache
    except Exception as exc:
        run.kernel_failed(ModelError(f"resume failed: {type(exc).__name__}: {exc}"))
        return
    eng._resumes += 1
    run.trace.emit(EventKind.RESUMED, mode=eng.preemption.value, cache_len=run.cache.length)


@SEQUENCE.effect("hold_reader")
def _hold_reader(eng: Engine, e: _Entry) -> None:
    e.parked_since = eng.clock()


@SEQUENCE.effect("release_reader")
def _release_reader(eng: Engine, e: _Entry) -> None:
    e.detached_since = e.parked_since = None


@SEQUENCE.effect("forget")
def _forget(eng: Engine, e: _Entry) -> None:
    """It reached its terminal state: kept for replay only (retain_s)."""
    e.snapshot = None
    if e in eng._swapped:
        eng._swapped.remove(e)
    with eng._lock:
        if eng._live.pop(e.run.request.request_id, None) is not None:
            eng._record_done(e.run)


_seq_plans_of = per_table(SEQUENCE.plans)


# ---- the Engine's implementation of every overlap effect (D73, spec/overlap.toml) -------------
# Each runs as (engine, entry, the step's row or None, the batch's greedy pick or None).
OVERLAP = Executor("overlap", "the runtime (engine.Engine)")


@OVERLAP.effect("start_step")
def _start_step(eng: Engine, e: _Entry, row: Any, pick: int | None) -> None:
    """The host work on y_t sees the cache as it was before the step (its length, a deferred free)."""
    _hold(e)


def _hold(e: _Entry) -> None:
    cache = e.run.cache
    e.held = _HeldCache(cache, cache.length)
    e.run.cache = e.held


@OVERLAP.effect("take_result")
def _take_result(eng: Engine, e: _Entry, row: Any, pick: int | None) -> None:
    eng._took(e, row, pick)


@OVERLAP.effect("discard_result")
def _discard_result(eng: Engine, e: _Entry, row: Any, pick: int | None) -> None:
    """Dropped; where decode.started is in the trace (a cancel observed after it), decode.completed
    follows and the lifecycle's own row discards the logits (§4.11 B), as without overlap."""
    if e.started:
        eng._took(e, row, None)


OVERLAP.abstracts("keep_cache", "the cache keeps what the step wrote; the request's release frees it with the rest")
OVERLAP.abstracts("release_resources", "the lifecycle's terminal row released them (runner); the Engine fires "
                  "release once the run is dropped, which the table refuses while its step is in flight")
_ov_plans_of = per_table(OVERLAP.plans)
