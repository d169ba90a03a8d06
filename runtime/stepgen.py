"""The writer of the step of §4.3 in runtime/runner.py (DECISIONS D53, D4): `check_point` and
`select` for every order of the lifecycle table's [[step]] that the loader accepts (each phase after
the phases whose result it reads: spec/vocabulary.STEP_NEEDS), and the shipped table's finish
checks as one function.

Each phase's code is here once (PHASES), over the locals the phases share (token, t, eos, special,
checked, new, safe, hit, event); a step function is its phases' code in one order, inline, so the
per-token path costs what hand-written code does and is code like any other: a traceback names
runner.py and a line, coverage and mypy see it. The finish checks are runtime/finish.py's
functions; their conditions are copied inline in the shipped table's order (another order runs
them one by one: finish.Composed). `decodespec codegen` writes it all into runner.py between two
marker lines; tests/test_step_order.py fails while that block differs from what `block()` gives,
so an edit of a phase, a check or the shipped list that is not written there fails.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import attrs

from ..spec import load_file, vocabulary
from ..spec.tables import FinishCheck
from ..spec.vocabulary import STEP_NEEDS
from . import finish

SHIPPED = Path(vocabulary.__file__).resolve().parent / "lifecycle.toml"  # whatever DECODESPEC_SPEC_DIR says

RUNNER = Path(__file__).with_name("runner.py")
BEGIN = "# ---- written by `decodespec codegen` from runtime/stepgen.py: edit the phases there, not below ----\n"
END = "# ---- end of the code `decodespec codegen` writes ----\n"


@attrs.frozen
class Phase:
    """One phase of the step: its section of chapter 4, a comment that says what it does, its code."""

    anchor: str
    comment: str
    code: str


PHASES: Mapping[str, Phase] = {
    "observe_cancel": Phase("§4.9", "a cancel requested by now is observed: nothing more is selected", """
if self._cancel_requested:
    self._observe_cancel()
    return False
"""),
    "observe_deadline": Phase("§4.9", "a deadline passed by now (or an injected one) ends the run", """
if self._deadline_forced or (self.deadline_at is not None and self.clock() >= self.deadline_at):
    self.trace.emit(EventKind.DEADLINE_EXCEEDED)
    self.fire("deadline")
    return False
"""),
    "choose": Phase("§4.3", "y_t: only tokens that keep the output valid UTF-8 (D16; greedy with a stop refuses only "
                    "the tokens that fail at once, D22); never an id the tokenizer cannot decode (D20). `token` "
                    "given: chosen by the caller from this run's logits (the Engine's one argmax over a greedy "
                    "batch)", """
guard = self.guard
if guard is not None:
    remaining = Utf8Guard.UNBOUNDED if self.sampler.greedy and (
        self.request.stop or self.token_stopper is not None) else min(
        self.request.max_output_tokens - len(self.tokens), self.model.context_limit - self.cache.length) - 1
    logits = guard.restrict(self.step_logits, self.detok.held, remaining)
    if token is None or logits[token] == float("-inf"):
        token = self.sampler.choose(logits)
elif self._undecodable is not None:
    if token is None or self._undecodable[token]:
        token = self.sampler.choose(self.step_logits.masked_fill(self._undecodable, float("-inf")))
elif token is None:
    token = self.sampler.choose(self.step_logits)
if self.scores is not None:
    self.scores.record(self.step_logits, token)
"""),
    "consume": Phase("§4.2", "y_t recorded and fired as `select`; a guard that turns the check of a not-text "
                     "token off makes it a token like any other (D31)", """
tokens = self.tokens
tokens.append(token)
t = len(tokens)
if self.life.state not in self._select_quiet:
    self.fire("select")
eos = token in self.eos_ids
special = eos or token in self._not_text
checked: int | None = token
if special and self._guarded is not None and self._guarded(self, token, t):
    eos = special = False
    checked = None
trace = self.trace
trace.put((_TOKEN_SELECTED, trace.clock(), t, token, eos))
"""),
    "push_bytes": Phase("§4.5", "EOS and a token check's ids are not text: no bytes (D4); usage counts a token's "
                        "bytes, held ones included, and a split character for each of its tokens (D7)", """
marks = self._byte_marks
if special:
    marks.append(marks[-1] if marks else 0)
else:
    try:
        new = self._detok_push(token)
    except DecodingError as exc:
        self.error = f"decoding_error: {exc}"
        marks.append(marks[-1] if marks else 0)
        self.fire("decode_error")
        return False
    total = self._detok_total = self._detok_total + len(new)
    marks.append(total + self.detok.held_bytes)
"""),
    "stop": Phase("§4.6", "the clock is read only when holding starts or ends; include_stop_str_in_output: the "
                  "match ends the output (D33)", """
if not special:
    if new:
        safe, hit = self._stop_push(new)
        if self.stopper.held:
            if self._held_since is None:
                self._held_since = self.clock()
        elif self._held_since is not None:
            self._t["stop_buffer"] += self.clock() - self._held_since
            self._held_since = None
    token_stopper = self.token_stopper
    if token_stopper is not None:
        safe, hit = self._token_stop(token_stopper, token, safe, hit)
    if hit is not None and self.stop_kept:
        safe += hit.own_bytes
"""),
    "finish_checks": Phase("§4.3", "the table's finish checks in its order (runtime/finish.py, D4): the event of the "
                           "first that holds fires after the emit", """
event = self._winner(self, eos, safe, hit, t, checked)
"""),
    "emit": Phase("§4.7", "a chunk the content policy refused is never sent (D11); nothing to check: straight to "
                  "the stream", """
if safe and event != _CONTENT_INTERRUPT:
    if self._plain_send:
        try:
            self.put_delta(safe)
        except StreamOverflow as exc:
            return self.effects.send_failed(exc.seq, str(exc))
        self.output += safe
    elif not self.effects.send(safe):
        return False
"""),
    "decode": Phase("§4.4", "the output ends at a match whichever check fixes the reason; after an interruption "
                    "nothing is kept", """
if hit is not None and event != _CONTENT_INTERRUPT:
    self.effects.record_hit(hit)
if event is None:
    return True
self.fire(event)
return False
"""),
}
# check_cancel_or_deadline (§4.3): the phases `check_point` runs; `select` runs the others.
OBSERVE = ("observe_cancel", "observe_deadline")


def orders(phases: Sequence[str], needs: Mapping[str, tuple[str, ...]] = STEP_NEEDS) -> list[tuple[str, ...]]:
    """Every order of `phases` in which each comes after those of its `needs` among them, the
    first in `phases`' own order."""

    def extend(done: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
        if len(done) == len(phases):
            yield done
        for p in phases:
            if p not in done and all(n in done for n in needs[p] if n in phases):
                yield from extend((*done, p))

    return list(extend(()))


def _function(phases: Mapping[str, Phase], name: str, signature: str, doc: str, order: tuple[str, ...], head: str,
              tail: str) -> str:
    body = head
    for p in order:
        phase = phases[p]
        comment = textwrap.fill(f"{p} ({phase.anchor}): {phase.comment}", 104, initial_indent="# ",
                                subsequent_indent="# ")
        body += comment + "\n" + phase.code.strip("\n") + "\n"
    body += tail
    docstring = textwrap.fill(f"{doc} Its phases: {', '.join(order)}.", 100, initial_indent='"""',
                              subsequent_indent="") + '"""\n'
    return f"def {name}({signature}) -> bool:\n" + textwrap.indent(docstring + body, "    ")


def _expression(check: FinishCheck) -> ast.expr:
    """The condition of `check`'s function in runtime/finish.py (its one `return`), over the
    winner's parameters; a token check's with its event."""
    fn = finish._token if check.tokens else finish.FINISH_CHECKS[check.event]
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = [s for s in node.body if not isinstance(s, ast.Expr)] if isinstance(node, ast.FunctionDef) else []
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        raise ValueError(f"runtime/finish.py: the check of {check.event!r} must be one `return` of its condition")
    expr = body[0].value
    return _Substitute({"event": check.event}).visit(expr) if check.tokens else expr


class _Substitute(ast.NodeTransformer):
    """Names replaced by string constants (a token check's `event`)."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.values = values

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self.values[node.id]) if node.id in self.values else node


def _source(expr: ast.expr) -> str:
    """`expr` as one line of source, its string literals in double quotes."""
    return re.sub(r"'([^'\"\\]*)'", r'"\1"', ast.unparse(expr))


def condition(check: FinishCheck) -> str:
    """The source of `check`'s condition as the shipped finish checks' function holds it."""
    return _source(_expression(check))


def _if(check: FinishCheck, width: int = 116) -> str:
    """`if <condition>: return "<event>"`, a long `and`/`or` condition one operand a line."""
    expr = _expression(check)
    line = f"if {_source(expr)}:"
    if len(line) + 4 > width and isinstance(expr, ast.BoolOp):
        joiner = "\n        and " if isinstance(expr.op, ast.And) else "\n        or "
        line = f"if ({joiner.join(_source(v) for v in expr.values)}):"
    return f'{line}\n    return "{check.event}"\n'


def _winner(checks: Sequence[FinishCheck]) -> str:
    body = ""
    for c in checks:
        body += f"# {c.event} ({c.anchor})\n" + _if(c)
    body += "return None\n"
    doc = textwrap.fill("The event of the first of the shipped lifecycle table's finish checks that holds, or None: "
                        f"runtime/finish.py's conditions inline, in the table's order: "
                        f"{', '.join(c.event for c in checks)}.", 100, initial_indent='"""') + '"""\n'
    return ("def _shipped_finish_checks(run: RequestRun, eos: bool, safe: bytes, hit: StopHit | None, t: int,\n"
            "                           token: int | None) -> str | None:\n" + textwrap.indent(doc + body, "    "))


def block(needs: Mapping[str, tuple[str, ...]] = STEP_NEEDS, phases: Mapping[str, Phase] = PHASES,
          checks: Sequence[FinishCheck] | None = None) -> str:
    """What runner.py holds between BEGIN and END: the step functions of every order `needs` allows,
    from the code of `phases`, `_STEPS` (the (check_point, select) pair of each full order), and
    the finish checks of `checks` (default: the shipped table's) as one function."""
    if set(needs) != set(phases):
        raise ValueError(f"spec/vocabulary.STEP_NEEDS and runtime/stepgen.PHASES differ: needs {sorted(needs)}, "
                         f"code {sorted(phases)}")
    if checks is None:
        checks = load_file(SHIPPED).finish_checks
    finish.finish_checks(checks)  # each listed check has its function, and each function its entry
    observe = orders(OBSERVE, needs)
    rest = orders([p for p in needs if p not in OBSERVE], needs)
    parts = []
    for i, order in enumerate(observe):
        parts.append(_function(phases, f"_check_point_{i}", "self: RequestRun",
                               "check_cancel_or_deadline (§4.3): True when the run may go on selecting.",
                               order, "", "return True\n"))
    for i, order in enumerate(rest):
        parts.append(_function(phases, f"_select_{i}", "self: RequestRun, token: int | None = None",
                               "Choose y_t (or take `token`, chosen by the caller from this run's logits) and run "
                               "every other phase of the step on it: True when y_t must be decoded next.",
                               order, 'new = safe = b""\nhit: StopHit | None = None\nevent: str | None = None\n', ""))
    pairs = "".join(textwrap.fill(", ".join(f'"{p}"' for p in (*a, *b)), 112, initial_indent="    (",
                                  subsequent_indent="     ") + f"): (_check_point_{i}, _select_{j}),\n"
                    for i, a in enumerate(observe) for j, b in enumerate(rest))
    steps = ("# Each order of the step's phases and its (check_point, select).\n"
             "_STEPS: dict[tuple[str, ...], tuple[Callable[[RequestRun], bool], Callable[..., bool]]] = {\n"
             f"{pairs}}}\n")
    shipped = textwrap.fill(", ".join(f'("{c.event}", {c.tokens})' for c in checks), 116, initial_indent="    ",
                            subsequent_indent="    ")
    listed = ("# The shipped table's finish checks as (event, token check?), in the order _shipped_finish_checks\n"
              f"# runs them.\n_SHIPPED_CHECKS = (\n{shipped},\n)\n")
    return "\n\n\n".join(part.rstrip("\n") for part in (*parts, steps, _winner(checks), listed)) + "\n"


def current(path: Path = RUNNER) -> str:
    """What `path` holds between its BEGIN and END lines."""
    text = path.read_text(encoding="utf-8")
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{path}: needs one line {BEGIN.strip()!r} and one {END.strip()!r}")
    return text[text.index(BEGIN) + len(BEGIN): text.index(END)].strip("\n") + "\n"


def write(path: Path = RUNNER) -> bool:
    """Put `block()` between `path`'s BEGIN and END lines; True when that changed the file."""
    text = path.read_text(encoding="utf-8")
    if current(path) == block():
        return False
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(text[:start] + "\n" + block() + "\n\n" + text[end:], encoding="utf-8")
    return True
