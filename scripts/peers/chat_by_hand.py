"""Send chosen chat requests to a running server on a chat checkpoint and print the raw exchange
(the non-streamed message, or each SSE delta with its finish_reason): how the failures of
reports/vllm-chat/confirmed.md were confirmed by hand (D48).

    .venv/bin/python scripts/peers/chat_by_hand.py URL CHECKPOINT_FOLDER
    .venv/bin/python scripts/peers/chat_by_hand.py URL CHECKPOINT_FOLDER CASE_ID:MAX_TOKENS ...

With cases named, each is sent both ways exactly as the runner sends it (chat.request_body: the
case's own fields, `tools` for a tool case, enable_thinking off for a case without reasoning) at
that max_tokens: how reports/llama-server-chat/confirmed.md was confirmed.
"""
import json
import sys

import httpx

from decodespec.properties.conformance.chat_cases import TOOLS
from decodespec.properties.conformance.wire import sse_lines

url, folder = sys.argv[1], sys.argv[2]
with open(f"{folder}/decodespec-checkpoint.json") as f:
    man = json.load(f)
model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
def ask(cid, stream, **kw):
    msg = man["chat"][cid]["message"]
    body = {"model": model, "messages": [{"role": "user", "content": msg}], "temperature": 0, **kw}
    if stream:
        body["stream"] = True
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    print(f"### {cid} {'stream' if stream else 'non-stream'} {json.dumps(kw)}")
    print("request:", json.dumps(body, ensure_ascii=False))
    if stream:
        for line in sse_lines((r.text,)):
            if line.startswith("data:"):
                try:
                    d = json.loads(line[5:])
                    ch = (d.get("choices") or [{}])[0]
                    print("  data delta:", json.dumps(ch.get("delta"), ensure_ascii=False), "finish:", ch.get("finish_reason"), "usage:", d.get("usage"))
                except ValueError:
                    print("  ", line)
    else:
        d = r.json()
        ch = d["choices"][0]
        print("  message:", json.dumps(ch["message"], ensure_ascii=False), "finish:", ch["finish_reason"], "usage:", d["usage"])
    print()
off = {"chat_template_kwargs": {"enable_thinking": False}}
if len(sys.argv) > 3:
    from types import SimpleNamespace

    from decodespec.properties.conformance.cases import load_cases
    from decodespec.properties.conformance.chat import request_body
    from decodespec.properties.conformance.checkpoints import with_chat

    for arg in sys.argv[3:]:
        cid, limit = arg.rsplit(":", 1)
        case = next(c for c in load_cases(["chat/"]) + with_chat(load_cases([cid.split("/", 1)[1]])) if c.id == cid)
        body = request_body(SimpleNamespace(model=model), case, man["chat"][cid]["message"], int(limit))
        fields = {k: v for k, v in body.items() if k not in ("model", "messages", "temperature")}
        ask(cid, False, **fields)
        ask(cid, True, **fields, stream_options={"include_usage": True})
    sys.exit(0)
ask("chat/reasoning/split-tags/001", False, max_tokens=8)
ask("chat/reasoning/split-tags/001", True, max_tokens=8)
ask("chat/reasoning/special-tags/001", True, max_tokens=6)
ask("chat/tool-call/special-tags/001", False, max_tokens=3, tools=TOOLS, **off)
ask("chat/tool-call/special-tags/001", True, max_tokens=2, tools=TOOLS, **off)
ask("chat/tool-call/special-tags/001", False, max_tokens=4, tools=TOOLS, **off)
ask("chat/tool-call/special-tags/001", True, max_tokens=4, tools=TOOLS, **off)
ask("chat/tool-call/stop-inside-json/001", True, max_tokens=5, tools=TOOLS, stop=["Paris"], **off)
ask("chat/finish/ignore-eos/001", False, max_tokens=4, ignore_eos=True, **off)
