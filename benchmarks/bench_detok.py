"""Incremental detokenizer per token vs tokenizers' DecodeStream and transformers' TextStreamer (§4.5).

The same ids (about 3000 tokens of byte-level BPE text with CJK, emoji and ZWJ sequences, so many
characters are split across tokens) go through:

- `IncrementalDetokenizer.push` (table lookup + UTF-8 check + one compiled-table step);
- `tokenizers.decoders.DecodeStream.step(tokenizer, id)` (Rust, re-decodes a small window);
- `transformers.TextStreamer.put(tensor([id]))` with its print redirected to a list (it re-decodes
  its cache up to the next newline).

Each round times every contender on the whole stream; the median over rounds is reported in µs per
token, with ratios to DecodeStream (target: ours <= 2x). The tokenizer is trained here (no download).
It then shows, on text ending with a genuine U+FFFD, what each one returns at the end: DecodeStream has
no flush, so a valid tail it is still holding is lost; `finish()` returns it.

Run: .venv/bin/python benchmarks/bench_detok.py [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from typing import Any

from tokenizers.decoders import DecodeStream

from decodespec.properties import fixtures
from decodespec.runtime.detokenizer import IncrementalDetokenizer
from decodespec.runtime.tokenizers import HFTokenizer, is_utf8

N_TOKENS = 3000


def stream_ids(tok: HFTokenizer, n: int = N_TOKENS) -> list[int]:
    text = " ".join(fixtures.CORPUS)
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(text + " ")
    ids = ids[:n]
    while not is_utf8(tok.decode_bytes(ids)):  # end on a character boundary
        ids.pop()
    return ids


def time_ours(tok: HFTokenizer, ids: list[int]) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    d = IncrementalDetokenizer(tok)
    push = d.push
    out = [push(i) for i in ids]
    out.append(d.finish())
    return time.perf_counter() - t0, b"".join(out)


def time_decode_stream(tok: HFTokenizer, ids: list[int]) -> tuple[float, bytes]:
    backend = tok.backend
    t0 = time.perf_counter()
    ds = DecodeStream(skip_special_tokens=True)
    step = ds.step
    out = [step(backend, i) for i in ids]
    elapsed = time.perf_counter() - t0
    return elapsed, "".join(s for s in out if s).encode()


def _text_streamer(path: str):
    """A TextStreamer whose output goes to a list instead of stdout, or None without transformers."""
    try:
        import torch
        from transformers import PreTrainedTokenizerFast, TextStreamer
    except ImportError:
        return None

    class SinkStreamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            self.sink.append(text)

    hf = PreTrainedTokenizerFast(tokenizer_file=path)

    def make():
        s = SinkStreamer(hf, skip_special_tokens=True)
        s.sink = []
        return s

    return make, torch


def time_text_streamer(factory, ids: list[int]) -> tuple[float, bytes]:
    make, torch = factory
    tensors = [torch.tensor([i]) for i in ids]  # built outside the timed loop
    t0 = time.perf_counter()
    s = make()
    put = s.put
    for t in tensors:
        put(t)
    s.end()
    return time.perf_counter() - t0, "".join(s.sink).encode()


def tail_demo(tok: HFTokenizer) -> dict[str, Any]:
    """Text ending with a genuine U+FFFD: what reaches the client from each at the end."""
    text = "done \ufffd"
    ids = tok.encode(text)
    ds = DecodeStream(skip_special_tokens=True)
    ds_out = "".join(s for s in (ds.step(tok.backend, i) for i in ids) if s)
    d = IncrementalDetokenizer(tok)
    ours = b"".join(d.push(i) for i in ids) + d.finish()
    return {"text": text, "batch_decode": tok.decode(ids), "decode_stream": ds_out, "ours": ours.decode()}


def run(rounds: int = 5) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        path = fixtures.byte_level_bpe(folder)
        tok = HFTokenizer(path)
        tok.plan()  # the per-token table is built once per tokenizer; not part of the per-token cost
        ids = stream_ids(tok)
        expected = tok.decode(ids).encode()
        streamer = _text_streamer(str(path))
        samples: dict[str, list[float]] = {"ours": [], "decode_stream": [], "text_streamer": []}
        outputs: dict[str, bytes] = {}
        for _ in range(rounds):
            for name, fn in (("ours", lambda: time_ours(tok, ids)),
                             ("decode_stream", lambda: time_decode_stream(tok, ids)),
                             ("text_streamer", (lambda: time_text_streamer(streamer, ids)) if streamer else None)):
                if fn is None:
                    continue
                elapsed, outputs[name] = fn()
                samples[name].append(elapsed / len(ids) * 1e6)
        us = {k: statistics.median(v) for k, v in samples.items() if v}
        result = {
            "tokens": len(ids),
            "rounds": rounds,
            "us_per_token": us,
            "ratio_ours_to_decode_stream": us["ours"] / us["decode_stream"],
            "matches_batch_decode": {k: v == expected for k, v in outputs.items()},
            "tail": tail_demo(tok),
        }
        if "text_streamer" in us:
            result["ratio_ours_to_text_streamer"] = us["ours"] / us["text_streamer"]
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    r = run(ap.parse_args().rounds)
    print(f"{r['tokens']} byte-level BPE tokens, median of {r['rounds']} rounds")
    for name, v in r["us_per_token"].items():
        print(f"  {name:14s} {v:8.3f} µs/token   equals batch decode: {r['matches_batch_decode'][name]}")
    print(f"  ours / DecodeStream = {r['ratio_ours_to_decode_stream']:.2f}  (target <= 2)")
    if "ratio_ours_to_text_streamer" in r:
        print(f"  ours / TextStreamer = {r['ratio_ours_to_text_streamer']:.3f}")
    t = r["tail"]
    print(f"tail: text {t['text']!r}, batch decode {t['batch_decode']!r}")
    print(f"  DecodeStream returned {t['decode_stream']!r} (no flush: the held tail is lost)")
    print(f"  ours (push + finish) {t['ours']!r}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
