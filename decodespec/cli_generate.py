"""`decodespec generate` and `decodespec experiment` (§4.3, §4.11)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import click

from decodespec.runtime.dtypes import DEFAULT_DTYPE, DTYPES


def check_device(device: str) -> str:
    """`--device` as torch names it; a name torch does not know, or CUDA where this torch build or
    machine has none, is a usage error naming what is missing (before any model loads)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise click.BadParameter(f"{device!r} is not a torch device ({exc}); use cpu, cuda or cuda:N",
                                 param_hint="--device") from None
    if dev.type == "cuda":
        if torch.version.cuda is None:
            raise click.BadParameter(f"{device!r}: this torch ({torch.__version__}) is a CPU build without CUDA",
                                     param_hint="--device")
        if not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count():
            raise click.BadParameter(f"{device!r}: no such CUDA device is visible ({torch.cuda.device_count()} found)",
                                     param_hint="--device")
    elif dev.type != "cpu":
        raise click.BadParameter(f"{device!r}: only cpu and cuda devices are supported", param_hint="--device")
    return str(dev)


def load_model_and_tokenizer(path: str | None, device: str = "cpu", dtype: str = DEFAULT_DTYPE):
    """The embedded TinyLM (path None), a TinyLM folder, or a transformers checkpoint folder, in
    `dtype` (a name of runtime/dtypes.DTYPES)."""
    from safetensors import SafetensorError

    from decodespec.runtime.models import HFModel, TinyLM
    from decodespec.runtime.tinylm import ASSETS, TinyLMConfig
    from decodespec.runtime.tokenizers import HFTokenizer

    device = check_device(device)
    folder = ASSETS if path is None else Path(path)
    config = folder / "config.json"

    def refuse(why: str) -> click.BadParameter:
        return click.BadParameter(f"{folder}: {why}", param_hint="--model")

    if not folder.is_dir():
        raise refuse("no such folder" if not folder.exists() else "a file, not a checkpoint folder")
    if not config.is_file():
        raise refuse("holds no config.json: not a checkpoint folder")
    try:
        keys = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise refuse(f"config.json is not JSON ({exc})") from None
    if not isinstance(keys, dict):
        raise refuse("config.json is not a JSON object")
    tinylm = set(keys) <= {f.name for f in attrs.fields(TinyLMConfig)}
    try:  # what transformers or the TinyLM loader refuses: missing or cut weights, an unknown model_type, a bad tokenizer
        model = (TinyLM.from_pretrained(folder, device=device, dtype=dtype) if tinylm
                 else HFModel(folder, device=device, dtype=dtype))
        return model, HFTokenizer(folder)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise refuse(f"cannot be loaded: {said[:300]}") from None


dtype_option = click.option("--dtype", type=click.Choice(DTYPES), default=DEFAULT_DTYPE, show_default=True,
                            help="The type the model's weights, KV cache and arithmetic are in.")

_TRACE_SUFFIXES = (".jsonl", ".json", ".ndjson", ".log", ".txt")


@click.command()
@click.argument("prompt", required=False)
@click.option("--stop", multiple=True, help="A stop string (repeatable); matched across tokens (§4.6).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=1), default=None)
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None)
@click.option("--seed", type=int, default=None)
@click.option("--model", "model_path", type=click.Path(), default=None, help="A TinyLM or transformers checkpoint folder (default: the embedded model).")
@click.option("--device", default="cpu", show_default=True)
@dtype_option
@click.option("--events", "events_to", type=click.Path(allow_dash=True), default=None, is_flag=False, flag_value="-",
              help="Write the event trace as JSON Lines to FILE (or stderr with --events alone).")
def generate(prompt, stop, max_tokens, temperature, top_k, top_p, seed, model_path, device, dtype, events_to) -> None:
    """Stream a completion of PROMPT as it is produced, then print how it ended."""
    from decodespec.runtime import Request
    from decodespec.runtime import generate as run_generate
    from decodespec.runtime.errors import RequestError
    from decodespec.runtime.events import write_jsonl

    if prompt is None:
        if events_to not in (None, "-") and not events_to.endswith(_TRACE_SUFFIXES):
            raise click.UsageError(f"--events took {events_to!r} as its file and no PROMPT is left: write "
                                   "--events FILE.jsonl PROMPT, or --events - PROMPT for stderr")
        raise click.UsageError("Missing argument 'PROMPT'.")
    model, tok = load_model_and_tokenizer(model_path, device, dtype)
    if not tok.encode(prompt):
        raise click.BadParameter("encodes to no tokens; give a non-empty prompt", param_hint="PROMPT")
    try:
        req = Request(prompt, stop=list(stop), max_output_tokens=max_tokens, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=seed)
    except RequestError as exc:
        raise click.BadParameter(str(exc)) from None
    trace = sys.stderr if events_to == "-" else _open_for_trace(events_to) if events_to else None
    decoder = _Utf8Writer(sys.stdout)
    res = run_generate(req, model=model, tokenizer=tok, on_delta=decoder.write)
    decoder.close()
    u = res.usage
    click.echo(
        f"[{res.state.value} {res.finish_reason}{' ' + repr(res.stop) if res.stop else ''}; "
        f"{u.selected_tokens} selected, {u.processed_tokens} processed, {u.returned_tokens} returned"
        f"{'; ' + res.error if res.error else ''}]",
        err=True,
    )
    if trace is not None:
        write_jsonl(res.events, trace)
        if trace is not sys.stderr:
            trace.close()
    if res.state.value == "FAILED":
        sys.exit(1)


def _open_for_trace(path: str):
    """Open the --events file before generating, so a path that cannot be written fails first."""
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise click.BadParameter(f"cannot write {path!r}: {exc.strerror}", param_hint="--events") from None


class _Utf8Writer:
    """Writes streamed bytes to a text stream; deltas are whole UTF-8 characters by construction."""

    def __init__(self, out) -> None:
        self.out = out

    def write(self, data: bytes) -> None:
        self.out.write(data.decode("utf-8"))
        self.out.flush()

    def close(self) -> None:
        self.out.write("\n")
        self.out.flush()


@click.command()
@click.argument("name", type=click.Choice(["A", "B", "a", "b"]))
def experiment(name: str) -> None:
    """Run experiment A or B of §4.11, print the event order and check its claims."""
    from decodespec.runtime.experiments import EXPERIMENTS

    exp = EXPERIMENTS[name.upper()]()
    click.echo(f"Experiment {exp.name}: {exp.title}")
    for ev in exp.result.events:
        click.echo(f"  {ev.index:3d}  {ev.describe()}")
    click.echo(f"output: {exp.result.output!r}   state: {exp.result.state.value}   reason: {exp.result.finish_reason}")
    for claim, ok in exp.claims:
        click.echo(f"  [{'PASS' if ok else 'FAIL'}] {claim}")
    if not exp.passed:
        sys.exit(1)
