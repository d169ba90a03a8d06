"""`decodespec serve`: the OpenAI-compatible reference server on uvicorn (§4.7-§4.10)."""

from __future__ import annotations

import click

from .cli_generate import dtype_option


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--model", "model_path", type=click.Path(), default=None,
              help="A TinyLM or transformers checkpoint folder (default: the embedded model).")
@click.option("--device", default="cpu", show_default=True)
@dtype_option
@click.option("--policy", type=click.Choice(["pause", "buffer", "fail"]), default="pause", show_default=True,
              help="Backpressure policy of every stream (§4.8, DECISIONS D6).")
@click.option("--max-batch", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch threads for the model's kernels, on the engine thread (default: torch's own; on a CPU "
                   "shared with the HTTP loop and other processes, fewer threads than cores avoid spinning against "
                   "them). The model is loaded on one (DECISIONS D60).")
@click.option("--pin-threads/--no-pin-threads", default=True, show_default=True,
              help="Each of those threads on a CPU of its own (DECISIONS D62): a kernel waits for its slowest "
                   "thread, and two of them sharing a core made a step take up to twice as long.")
@click.option("--max-queue", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--cache-budget-tokens", type=click.IntRange(min=1), default=None,
              help="KV cache tokens on the device before preemption (§4.8); default unbounded.")
@click.option("--preemption", type=click.Choice(["swap", "recompute"]), default="swap", show_default=True)
@click.option("--detach-timeout", "detach_timeout_s", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds a paused request whose client disconnected waits before transport_error (D5).")
@click.option("--stall-timeout", "stall_timeout_s", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds a paused request whose client is connected but not reading waits before transport_error.")
@click.option("--shutdown-timeout", "shutdown_timeout_s", type=click.FloatRange(min=0), default=10.0,
              show_default=True, help="On SIGTERM: seconds open connections get before the server closes them and "
                                      "ends every live request with a terminal event.")
@click.option("--on-disconnect", type=click.Choice(["continue", "cancel"]), default="continue", show_default=True,
              help="What a streaming client's disconnect does (DECISIONS D5); a non-streamed request whose client "
                   "leaves is always cancelled.")
@click.option("--body-timeout", "body_timeout_s", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Seconds a request body may take to arrive (408 past it).")
@click.option("--header-timeout", "header_timeout_s", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds a connection may take to send a request's headers (408 and closed past it).")
@click.option("--api-key", envvar="DECODESPEC_API_KEY", default=None,
              help="Require Authorization: Bearer KEY on every route but /health (env DECODESPEC_API_KEY).")
@click.option("--allow-origin", "allowed_origins", multiple=True,
              help="A browser Origin allowed to call the server (repeatable); any other Origin is refused.")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=4 << 20, show_default=True,
              help="Largest request body read; past it the answer is 413 before any parsing.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True,
              help="Server log level; at info and below every request is logged (method, path, status).")
@click.option("--utf8-guard", type=click.Choice(["sampled", "always", "never"]), default="sampled", show_default=True,
              help="Which requests that do not set utf8_guard sample only tokens that keep the output valid "
                   "UTF-8 (DECISIONS D16): sampled ones (temperature > 0), all, or none.")
@click.option("--batch-invariant", is_flag=True, default=False,
              help="Run every kernel call on one sequence: tokens then never depend on batching or "
                   "preemption, in any dtype (slower; see runtime/engine.py on exactness).")
@click.option("--overlap", is_flag=True, default=False,
              help="Launch each decode step before its tokens are detokenized, matched and streamed (on a worker "
                   "thread); a request found to end meanwhile has the step's result discarded (DECISIONS D73).")
@click.option("--context-limit", "context_limit", type=click.IntRange(min=2), default=None,
              help="Serve with a context of this many positions, below the checkpoint's own (§4.3, D10: a run "
                   "ends with context_limit when no position is left for the next token).")
@click.option("--strict", is_flag=True, default=False,
              help="Accept only the core request fields (model, prompt or messages, max_tokens, "
                   "max_completion_tokens, temperature, top_p, stop, stop_token_ids, seed, logprobs, top_logprobs, "
                   "stream, stream_options, user, utf8_guard) and n = 1: any other field (penalties, logit_bias, "
                   "echo, best_of, an engine extension) is an unknown-field 400 (DECISIONS D30).")
@click.option("--retain", "retain_s", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds a finished request stays available for replay (Last-Event-ID).")
@click.option("--retain-count", "max_retained", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Finished requests kept for replay at most; past it the oldest is dropped before --retain.")
@click.option("--max-readers", type=click.IntRange(min=1), default=8, show_default=True,
              help="Open readers one request may have (its stream and each /events resume); 429 past it (D5).")
@click.option("--watchdog", "watchdog_s", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="/health answers 503 'stalled' while one engine step has run longer than this (DECISIONS D21).")
@click.option("--reasoning-parser", type=click.Choice(["none", "think"]), default="none", show_default=True,
              help="think: chat answers split <think>...</think> into reasoning_content (DECISIONS D45).")
@click.option("--tool-call-parser", type=click.Choice(["none", "hermes"]), default="none", show_default=True,
              help="hermes: chat requests with tools get <tool_call>{json}</tool_call> as tool_calls (D47).")
def serve(host, port, model_path, device, dtype, policy, max_batch, threads, pin_threads, max_queue, cache_budget_tokens, preemption,
          detach_timeout_s, stall_timeout_s, shutdown_timeout_s, on_disconnect, body_timeout_s, header_timeout_s, api_key,
          allowed_origins, max_body_bytes, log_level, utf8_guard, batch_invariant, overlap, context_limit, strict, retain_s,
          max_retained, max_readers, watchdog_s, reasoning_parser, tool_call_parser) -> None:
    """Serve /v1/completions and /v1/chat/completions (SSE with replayable ids) until interrupted."""
    import logging

    from decodespec.runtime.engine import Engine
    from decodespec.runtime.server import ServerConfig, create_app, reference_server, uvicorn_config

    from .cli_generate import load_model_and_tokenizer

    if api_key is not None and not api_key.strip():  # an empty key must not turn auth off silently
        raise click.UsageError("--api-key (or DECODESPEC_API_KEY) is empty: give a key, or unset it to serve "
                               "without authentication")
    import torch

    # D60: the engine thread alone runs kernels on several threads; this one loads the model on one,
    # so that it never makes an OpenMP team of its own (with two teams on the cores, libgomp's
    # workers stop spinning between kernels and every kernel waits for them to wake).
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(model_path, device, dtype)
    if context_limit is not None:
        if context_limit > model.context_limit:
            raise click.BadParameter(f"{context_limit} exceeds the model's own context of {model.context_limit}",
                                     param_hint="--context-limit")
        model.context_limit = context_limit
    engine = Engine(model, tok, max_batch=max_batch, max_queue=max_queue, cache_budget_tokens=cache_budget_tokens,
                    preemption=preemption, detach_timeout_s=detach_timeout_s, stall_timeout_s=stall_timeout_s,
                    retain_s=retain_s, max_retained=max_retained, batch_invariant=batch_invariant, threads=threads,
                    pin_threads=pin_threads, overlap=overlap)
    app = create_app(engine, ServerConfig(
        policy=policy, api_key=api_key, allowed_origins=frozenset(allowed_origins), max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s, on_disconnect=on_disconnect, utf8_guard=utf8_guard, watchdog_s=watchdog_s,
        strict=strict, max_readers=max_readers, reasoning_parser=reasoning_parser == "think",
        tool_parser=tool_call_parser == "hermes"))
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")  # the server's own lines (fields not acted on)
    logging.getLogger("decodespec").setLevel(log_level.upper())
    click.echo(f"decodespec serve: model {engine.model_name!r} on http://{host}:{port}/v1 (policy {policy})", err=True)
    config = uvicorn_config(app, host=host, port=port, log_level=log_level, access_log=log_level in ("debug", "info"),
                            header_timeout_s=header_timeout_s)
    reference_server(config, engine, shutdown_timeout_s).run()
    if engine.failure is not None:  # the engine failed and the server shut down (D21)
        raise SystemExit(f"decodespec serve: the engine failed: {type(engine.failure).__name__}: {engine.failure}")
