"""Forced checkpoints in float32, bfloat16 and float16 (D25): which programs follow their script.

    .venv/bin/python benchmarks/bench_forced_dtypes.py [--out DIR] [--attn sdpa eager]

Builds every checkpoint of the HTTP-runnable cases (as `decodespec checkpoints build` does) and one
more whose single program's script fills the context (509 tokens of mixed-script text after a
3-token prompt), then runs transformers generate, greedy, on every program (the prefix probe bare
and behind a BOS included) in each dtype and attention implementation. Per dtype it prints: the
programs that follow their script exactly, the smallest logit margin transformers itself showed
(wanted logit minus the best other) at scripted steps and at the EOS steps, the smallest gate
margin `check_margins` computed with the dtype's rounding (a fraction of the designed one), and how
many tokens of the long script were followed. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decodespec.properties.conformance import load_cases
from decodespec.properties.conformance.cases import parse_case
from decodespec.properties.conformance.checkpoints import (
    TABLE_GROUP,
    Checkpoint,
    build_checkpoints,
    build_group,
    proof_runs,
)
from decodespec.properties.conformance.forced import CONTEXT, DTYPES
from decodespec.properties.fixtures import CORPUS

LONG = "bench/forced-long/001"


def long_checkpoint(folder: Path) -> Checkpoint:
    """A byte-table checkpoint whose one program writes mixed-script text up to the context's end."""
    data = " ".join(CORPUS).encode()[: CONTEXT - 3]
    text = data.decode("utf-8", "ignore")  # whole characters only
    case = parse_case({
        "id": LONG, "anchor": "§4.3", "grade": "MUST", "invariant": "length_respected",
        "description": "a script as long as the context", "kind": "script",
        "inputs": {"tokenizer": {"table": {"1": "> ", "2": "</s>"}, "eos": 2}, "prompt": [1],
                   "script": [{"text": text}], "max_tokens": CONTEXT},
    })
    return build_group(TABLE_GROUP, [case], folder)


def measure(ck: Checkpoint, dtype: str, attn: str) -> list[dict]:
    """Every proof run of `ck` through transformers generate: followed?, first difference, margins."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ck.folder, dtype=getattr(torch, dtype), attn_implementation=attn)
    model.eval()
    runs = proof_runs(ck)
    width = max(len(p) for _, p, _ in runs)
    ids = torch.tensor([[ck.eos_id] * (width - len(p)) + p for _, p, _ in runs])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p, _ in runs])
    n = max(len(w) for _, _, w in runs)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=ck.eos_id, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, 1).float()  # [batch, steps, V]
    rows = []
    for b, (name, _, want) in enumerate(runs):
        got = out.sequences[b, width:width + len(want)].tolist()
        lg = logits[b, : len(want)].clone()
        w = torch.tensor(want)
        top = lg[torch.arange(len(want)), w].clone()
        lg[torch.arange(len(want)), w] = -float("inf")
        gap = (top - lg.max(1).values).tolist()
        at_eos = [g for g, t in zip(gap, want) if t == ck.eos_id]
        scripted = [g for g, t in zip(gap, want) if t != ck.eos_id]
        first = next((i for i, (a, c) in enumerate(zip(got, want)) if a != c), None)
        rows.append({"name": name, "follows": first is None, "first": first, "length": len(want) - 1,
                     "scripted": min(scripted, default=float("inf")), "eos": min(at_eos, default=float("inf"))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="folder for the checkpoints (default: a temporary one)")
    ap.add_argument("--attn", nargs="+", default=["sdpa", "eager"])
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="forced-dtypes-"))
    built = build_checkpoints(load_cases(), out / "cases")
    long_ck = long_checkpoint(out / "long")
    print(f"{len(built)} checkpoints ({sum(len(c.programs) for c in built)} programs) and the long one "
          f"({len(long_ck.programs[LONG].script)} script tokens) under {out}\n")
    print("| dtype | attention | programs that follow their script | smallest logit margin, scripted / EOS step "
          "| gate margin (check_margins) | longest script carried |")
    print("|---|---|---|---|---|---|")
    for dtype in DTYPES:
        gate = min(c.margins[dtype]["gate"] for c in [*built, long_ck])
        for attn in args.attn:
            rows = [r for c in built for r in measure(c, dtype, attn)]
            [long_row] = [r for r in measure(long_ck, dtype, attn) if r["name"] == LONG]
            carried = long_row["length"] if long_row["follows"] else long_row["first"]
            print(f"| {dtype} | {attn} | {sum(r['follows'] for r in rows)}/{len(rows)} | "
                  f"{min(r['scripted'] for r in rows):.2f} / {min(r['eos'] for r in rows):.2f} | {gate:.2f} | "
                  f"{carried} of {long_row['length']} tokens (margin {long_row['scripted']:.2f}) |")


if __name__ == "__main__":
    main()
