"""Confirm a gateway-only finding by hand on the raw exchange: the same requests to the worker and to the
gateway in front of it, both raw answers printed; or a stream cut and the worker's running gauge watched.

    python scripts/peers/gateway_by_hand.py same WORKER_URL GATEWAY_URL REQUESTS.json
        REQUESTS.json: [[label, body], ...], each body POSTed to /v1/completions of both
    python scripts/peers/gateway_by_hand.py disconnect WORKER_URL GATEWAY_URL GAUGE MODEL PROMPT MAX_TOKENS
        a stream of MAX_TOKENS (ignore_eos) read for 8 events and closed, directly then through the gateway;
        the worker's /metrics GAUGE (summed over its labels) polled until it is 0

The reports' confirmed.md files quote what these printed.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import httpx


def same(worker: str, gateway: str, requests: str) -> None:
    for label, body in json.loads(Path(requests).read_text(encoding="utf-8")):
        for name, url in (("direct", worker), ("gateway", gateway)):
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            print(f"=== {label} / {name}: POST /v1/completions {json.dumps(body)}\n--- {r.status_code}\n{r.text.strip()}\n")


def disconnect(worker: str, gateway: str, gauge: str, model: str, prompt: str, max_tokens: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": int(max_tokens), "stream": True, "temperature": 0,
            "ignore_eos": True}
    line_of = re.compile(rf"^{re.escape(gauge)}(?:{{[^}}]*}})? ([0-9.e+]+)$", re.M)

    def running() -> float:
        return sum(float(m.group(1)) for m in line_of.finditer(httpx.get(worker + "/metrics").text))

    for name, url in (("direct", worker), ("gateway", gateway)):
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data:")
                if events == 8:
                    break
            before = running()
        t0 = time.monotonic()
        while running() > 0 and time.monotonic() - t0 < 30:
            time.sleep(0.02)
        print(f"{name}: {gauge} was {before:g} at the cut; 0 after {time.monotonic() - t0:.2f} s")


COMMANDS = {"same": (same, 3), "disconnect": (disconnect, 6)}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS or len(sys.argv) - 2 != COMMANDS[sys.argv[1]][1]:
        sys.exit(__doc__)
    COMMANDS[sys.argv[1]][0](*sys.argv[2:])
