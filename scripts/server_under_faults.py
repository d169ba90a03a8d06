"""The server under faults (DECISIONS D20): 16 clean streams beside a stream whose logits
hold +inf, one whose argmax is an id the tokenizer cannot decode, one whose content policy raises,
and a prompt holding an undecodable id; prints each outcome and the clean streams' times. With
`clean`, the 16 streams alone (the ratio side by side). From the repository root:

    .venv/bin/python scripts/server_under_faults.py [clean]
"""

from __future__ import annotations

import json
import sys
import threading
import time

import attrs
import httpx

sys.path.insert(0, "tests")
from _engine_kit import VOCAB, ascii_tokenizer, serve_in_thread, tiny_model
from test_fault_containment import INF_LEN, PAD_LEN, PoisonModel, _boom_at, _prompt

from decodespec.properties.conformance.wire import sse_lines
from decodespec.runtime.engine import Engine
from decodespec.runtime.server import create_app

POLICY_LEN = 13  # the prompt length whose request gets a content policy that raises on its 2nd chunk


def main(clean: bool) -> dict:
    engine = Engine(PoisonModel(tiny_model()), ascii_tokenizer(), poll_s=0.001)
    submit = engine.submit

    def with_policy(request, faults=None):  # the HTTP body has no policy: attached by prompt length
        if len(request.prompt) == POLICY_LEN:
            request = attrs.evolve(request, content_policy=_boom_at(2), finish_tokens=dict(request.finish_tokens))
        return submit(request, faults)

    engine.submit = with_policy
    out: dict = {}
    with serve_in_thread(create_app(engine, model_name="tiny")) as url:
        def stream(name: str, prompt: list[int]) -> None:
            t0 = time.monotonic()
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 48, "stream": True, "temperature": 0.7,
                    "seed": 7}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=20) as r:
                    lines = list(sse_lines(r.iter_text()))
                errors = [json.loads(ln[6:])["error"]["message"] for ln in lines if ln.startswith('data: {"error')]
                end = "done" if "data: [DONE]" in lines else (errors or lines[-3:])[0]
            except httpx.HTTPError as exc:
                end = f"client gave up: {type(exc).__name__}"
            out[name] = (end, round(time.monotonic() - t0, 3))

        jobs = [(f"ok{i}", _prompt(6 + i % 4)) for i in range(16)]
        if not clean:
            jobs += [("inf", _prompt(INF_LEN)), ("undecodable_argmax", _prompt(PAD_LEN)),
                     ("raising_policy", _prompt(POLICY_LEN))]
        t0 = time.monotonic()
        threads = [threading.Thread(target=stream, args=job) for job in jobs]
        for t in threads:
            t.start()
        if not clean:
            bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [1, VOCAB + 2], "max_tokens": 4},
                             timeout=20)
            out["undecodable_prompt"] = (bad.status_code, bad.headers.get("content-type"))
        for t in threads:
            t.join(30)
        wall = time.monotonic() - t0
        ok = sorted(t for name, (end, t) in out.items() if name.startswith("ok") and end == "done")
        return {"wall_s": round(wall, 3), "clean_finished": len(ok), "clean_p50_s": ok[len(ok) // 2] if ok else None,
                "clean_max_s": ok[-1] if ok else None, "health": httpx.get(f"{url}/health", timeout=5).status_code,
                **{k: v for k, v in out.items() if not k.startswith("ok")}}


if __name__ == "__main__":
    print(json.dumps(main("clean" in sys.argv), indent=1))
