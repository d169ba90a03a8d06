"""One request of the model checker's abstract model (machine/checker_model.py), as a record.

`RequestState` is a NamedTuple of small ints, read by field name (`c.lifecycle`). The search keeps
its requests as plain tuples of the same fields (equal, with the same hash; the garbage collector
skips a tuple of ints, not a NamedTuple) and the model reads each as a RequestState. A step under
construction (checker_model.Step) holds a list of the fields and writes them through `F`, the
record of each field's index (`f[F.selected] += 1`). The fields that are not a table's state index
take the values the small tables below name (`PC.sending`, `CANCEL.observed`); their field names are
what a counterexample prints (checker_model.Model.describe). `Judged` is the part of a request
the state checks read (machine/checker_invariants.py).
"""

from __future__ import annotations

from operator import itemgetter
from typing import NamedTuple


class RequestState(NamedTuple):
    """Where one request is: the loop's program counter, each control machine's state index in its
    table (lifecycle, stream, the five resources, stop matcher, detokenizer, sequence) and bounded
    data (§4.3, §4.7-§4.10)."""

    pc: int  # where in generate() the request is: a value of PC
    lifecycle: int
    stream: int
    trace_handle: int  # the resources, one field per kind (RESOURCE_KINDS), from trace_handle to rng_state
    stream_buffer: int
    kv_cache: int
    batch_slot: int
    rng_state: int
    stop_matcher: int
    detokenizer: int
    selected: int  # output tokens selected
    decoded: int  # output tokens decoded
    seq: int  # deltas queued on the stream
    reason: int  # the finish reason fixed: an index of checker_model.REASONS (0: none yet)
    cancel: int  # a value of CANCEL
    deadline: int  # a value of DEADLINE
    kernel: int  # the kernel in flight: a value of KERNEL
    policy: int  # the backpressure policy: an index of ModelConfig.policies
    unread: int  # queued deltas the reader has not read
    reader: int  # a value of READER
    ret: int  # where the loop goes on (a value of PC) once the delta it is sending is queued
    eos: int  # a value of EOS
    terminals: int  # terminal events queued
    freed: int  # one bit per resource kind (RESOURCE_KINDS order) whose free callback ran
    lost: int  # 1 once output bytes that were neither sent nor discarded by a row went nowhere
    sequence: int  # where the Engine holds the sequence (spec/sequence.toml)
    preempted: int  # how often the scheduler preempted it
    guard: int  # the finish guard's request field it sets: 0 none, i: ModelConfig.guards[i - 1]


F = RequestState(*range(len(RequestState._fields)))  # each field's index, for the list of a step under construction
RESOURCE_KINDS = RequestState._fields[F.trace_handle:F.rng_state + 1]
RES_FIELD = {kind: F.trace_handle + i for i, kind in enumerate(RESOURCE_KINDS)}
# The control machines' fields (each resource kind has its own: RES_FIELD).
FIELD_OF = {m: RequestState._fields.index(m) for m in ("lifecycle", "stream", "stop_matcher", "detokenizer", "sequence")}


class Judged(NamedTuple):
    """The fields of a request the state checks read, in RequestState's order: requests that agree
    on them are judged once, and a check that reads another field fails (AttributeError) instead of
    being judged on a field this key does not hold."""

    pc: int
    lifecycle: int
    stream: int
    trace_handle: int
    stream_buffer: int
    kv_cache: int
    batch_slot: int
    rng_state: int
    selected: int
    decoded: int
    reason: int
    cancel: int
    deadline: int
    kernel: int
    unread: int
    eos: int
    terminals: int
    freed: int
    lost: int
    sequence: int
    guard: int


judged_key = itemgetter(*(RequestState._fields.index(f) for f in Judged._fields))  # a request's Judged fields


class Pc(NamedTuple):
    """The program counter's values: where in generate() (§4.3) a request is."""

    new: int
    created: int
    queued: int
    prefill_in_flight: int
    top_of_step: int
    finish_checks: int
    decode_in_flight: int
    sending: int
    safe_point: int
    draining_finish: int
    draining_stop_hit: int
    draining_flush: int
    draining_end: int
    closing: int
    done: int
    interrupt_after_emit: int


class Cancel(NamedTuple):
    """A cancel's progress (§4.9): asked for, seen at a check point, asked for again."""

    none: int
    requested: int
    observed: int
    repeated: int


class Deadline(NamedTuple):
    """The deadline's progress (§4.9)."""

    none: int
    passed: int
    observed: int


class Kernel(NamedTuple):
    """The kernel in flight."""

    none: int
    prefill: int
    decode: int


class Reader(NamedTuple):
    """The stream's reader (§4.7)."""

    connected: int
    disconnected: int
    reconnected: int


class Eos(NamedTuple):
    """An EOS selected: none, one that ended the run, or one a guard turned off that went on as a
    token (D31)."""

    none: int
    ended: int
    decoded: int


PC = Pc(*range(len(Pc._fields)))
PC_NAMES = Pc._fields
CANCEL = Cancel(*range(len(Cancel._fields)))
DEADLINE = Deadline(*range(len(Deadline._fields)))
KERNEL = Kernel(*range(len(Kernel._fields)))
READER = Reader(*range(len(Reader._fields)))
EOS = Eos(*range(len(Eos._fields)))
