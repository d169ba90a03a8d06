"""generate(): the single-path loop of §4.3, step for step, over a RequestRun.

Model kernels run on a worker thread (runner.run_kernel) so that a cancel can land while a step
is in flight: the step completes, its result is discarded, nothing is selected after it (§4.9).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..spec import Spec, Table
from .errors import ModelError
from .faults import FaultPlan
from .request import Request
from .result import Result
from .runner import RequestRun, run_kernel


def generate(
    request: Request,
    *,
    model: Any,
    tokenizer: Any,
    faults: FaultPlan | None = None,
    on_delta: Callable[[bytes], None] | None = None,
    on_run: Callable[[RequestRun], None] | None = None,
    read_inline: bool = True,
    spec: Spec | None = None,
    lifecycle: Table | None = None,
) -> Result:
    """Run one request to its terminal state and return the Result with its full trace.

    `on_delta(bytes)` sees each delta as it is sent; `on_run(run)` gets the RequestRun before the
    loop starts (to subscribe to its trace or to cancel it from another thread).
    With `read_inline` False nobody reads the stream while the loop runs, so its backpressure
    policy decides what happens at the cap (§4.8): `buffer`/`fail` overflow, `pause` parks until
    the stream's pause timeout. `spec`: the tables the run follows (default: the spec directory's,
    spec/ or DECODESPEC_SPEC_DIR); `lifecycle`: a lifecycle table in place of the spec's.
    """
    if not isinstance(request, Request):
        raise TypeError(f"generate() takes a Request, got {type(request).__name__}")
    run = RequestRun(request, model=model, tokenizer=tokenizer, faults=faults, spec=spec,
                     lifecycle=lifecycle)
    if on_delta is not None:
        run.on_delta(on_delta)
    if on_run is not None:
        on_run(run)
    # generate() is its own reader: what it sends is consumed at once, so the stream's
    # backpressure never parks a single-path request (the Engine is where slow readers matter).
    run.inline_reader = read_inline
    if not run.admit() or not run.check_point():
        return run.finish()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kernel-{request.request_id}") as pool:
        try:
            logits, cache = run_kernel(run, lambda: model.prefill(run.prompt_ids), run.begin_prefill, pool)
        except ModelError as exc:
            run.kernel_failed(exc)
            return run.finish()
        run.end_prefill(logits, cache)

        def decode_selected() -> Any:
            """The model's step on the token just selected (the last of the run's tokens)."""
            return model.decode_one([run.cache], [run.tokens[-1]])[0]

        while run.decoding and run.check_point():
            try:
                if not run.select():
                    break
            except Exception as exc:  # its sampler, tokenizer, policy or grammar raised (D20)
                run.crashed(exc, "selecting a token")
                break
            try:
                logits = run_kernel(run, decode_selected, run.begin_decode, pool)
            except ModelError as exc:
                run.kernel_failed(exc)
                break
            run.end_decode(logits)
    return run.finish()
