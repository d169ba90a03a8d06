"""Replay a request-life case of a decodespec report against an engine (curl cannot send it).

    python3 replay.py [URL]          (default $URL, else http://127.0.0.1:8000; Python 3.8+, stdlib only)

CASE below holds the case's recipe, its parameters and the requests its run recorded. `load`
recipes send every request alone, then IN_FLIGHT of them at once, and print each answer under load
that differs from the same request alone (§4.8: nothing that runs beside a request may change it)
or a stream that ends without its finish chunk (§4.7). `disconnect` recipes cut SLOTS long streams
after CUT_AT deltas, then time how soon new streams start (§4.9, §4.10). `resume` cuts a stream and
resumes it with Last-Event-ID (§4.7). Exit status 1 when it sees what the report found.
(decodespec's reports write this file from properties/conformance/replay_script.py.)
"""

import json
import os
import sys
import threading
import time
import urllib.parse
from http.client import HTTPConnection

CASE: dict = {}  # the reproducer puts the case's data here
URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("URL", "http://127.0.0.1:8000")


def send(req, cut_after=None, headers=None):
    """One request: its status, text, finish reasons, [DONE] seen, SSE ids, X-Request-Id and the time of
    its first delta; a stream is closed after `cut_after` deltas."""
    u = urllib.parse.urlsplit(URL)
    conn = HTTPConnection(u.hostname, u.port or 80, timeout=CASE["inputs"].get("timeout_s", 300))
    body = json.dumps(req.get("body")) if req.get("method", "POST") == "POST" else None
    conn.request(req.get("method", "POST"), req["path"], body=body,
                 headers={"Content-Type": "application/json", **(headers or {}), **req.get("headers", {})})
    r = conn.getresponse()
    stream = req.get("method", "POST") != "POST" or (req.get("body") or {}).get("stream")
    out = {"status": r.status, "text": "", "finish": [], "done": False, "ids": [], "first": None,
           "request_id": r.getheader("X-Request-Id")}
    if r.status != 200:
        out["text"] = r.read().decode("utf-8", "replace")[:300]
        print(f"{req.get('method', 'POST')} {req['path']} answered {r.status}: {out['text']}")
    elif not stream:
        data = json.loads(r.read() or b"null")
        choices = (data or {}).get("choices") or [{}]
        out.update(text=choices[0].get("text") or (choices[0].get("message") or {}).get("content") or "",
                   finish=[c.get("finish_reason") for c in choices], first=time.monotonic())
    if r.status != 200 or not stream:
        conn.close()
        return out
    deltas = 0
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("id:"):
            out["ids"].append(line[3:].strip())
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            out["done"] = True
            break
        for c in json.loads(data).get("choices") or []:
            piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
            if piece:
                deltas += 1
                out["text"] += piece
                out["first"] = out["first"] or time.monotonic()
            if c.get("finish_reason"):
                out["finish"].append(c["finish_reason"])
        if cut_after is not None and deltas >= cut_after:
            break
    conn.close()
    return out


def at_once(reqs, **kw):
    """Every request at the same instant, each on its own connection."""
    gate, got = threading.Barrier(len(reqs)), [None] * len(reqs)

    def one(i):
        gate.wait()
        got[i] = send(reqs[i], **kw)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def load():
    reqs = [e["request"] for e in CASE["exchanges"]]
    n = int(CASE["inputs"].get("in_flight", len(reqs)))
    alone = [send(q) for q in reqs]
    key = ("status", "text", "finish", "done")
    bad = 0
    for i, got in enumerate(at_once([reqs[i % len(reqs)] for i in range(n)])):
        want = alone[i % len(reqs)]
        streamed = (reqs[i % len(reqs)].get("body") or {}).get("stream")
        if [got[k] for k in key] != [want[k] for k in key] or (streamed and not got["finish"]):
            bad += 1
            print(f"request {i + 1} of {n} at once: {[got[k] for k in key]}; alone: {[want[k] for k in key]}")
    print(f"{bad} of {n} answers under load differ from the same request alone or lack their finish chunk")
    return bad == 0


def disconnect():
    long_req, new_req = (e["request"] for e in CASE["exchanges"][:2])
    slots, cut, bound = int(CASE["inputs"]["slots"]), int(CASE["inputs"]["cut_at"]), float(CASE["inputs"]["bound_s"])
    t0 = time.monotonic()
    whole = send(long_req)
    rest_s = (time.monotonic() - (whole["first"] or t0))
    at_once([long_req] * slots, cut_after=cut)
    gone = time.monotonic()
    fresh = at_once([long_req] + [new_req] * (slots - 1))
    starts = [round(f["first"] - gone, 2) if f["first"] else None for f in fresh]
    print(f"{slots} long streams cut after {cut} deltas; new streams started after {starts} s "
          f"(bound {bound} s; the long stream's rest alone takes about {rest_s:.2f} s)")
    late = [s for s in starts if s is None or s > bound]
    if CASE["recipe"] == "disconnect_abort" and not late and max(starts) >= 0.8 * rest_s:
        print("the new streams waited about as long as the abandoned ones' rest; timing alone does not decide "
              "whether the work went on (the report reads the engine's running gauges and decode counter for that, D72)")
    return not late


def resume():
    req = CASE["exchanges"][0]["request"]
    cut = int(CASE["inputs"]["cut_at"])
    want = send({**req, "body": {**req["body"], "stream": False}})["text"]
    first = send(req, cut_after=cut)
    print(f"cut after {cut} deltas: SSE ids {first['ids'][-3:]}, X-Request-Id {first['request_id']}")
    if not first["ids"] or not first["request_id"]:
        print("no SSE id or no X-Request-Id: a client cannot resume this stream")
        return False
    rest = send({"method": "GET", "path": f"/v1/requests/{first['request_id']}/events"},
                headers={"Last-Event-ID": first["ids"][-1]})
    ok = rest["status"] == 200 and first["text"] + rest["text"] == want and rest["finish"] and rest["done"]
    print(f"resumed: status {rest['status']}, finish {rest['finish']}, [DONE] {rest['done']}; text before the cut "
          f"plus the resumed text {'equals' if ok else 'differs from'} the whole answer")
    return bool(ok)


FLOWS = {"batch_exact": load, "terminal_under_load": load, "preemption": load,
         "disconnect_frees": disconnect, "disconnect_abort": disconnect, "resume": resume}

if __name__ == "__main__":
    print(f"{CASE['id']} ({CASE['recipe']}) against {URL}")
    sys.exit(0 if FLOWS[CASE["recipe"]]() else 1)
