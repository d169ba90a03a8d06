# my_engine.py: decodespec conform --engine my_engine:make --checkpoint ckpts --report reports/my-engine
"""An in-house engine's adapter, written against decodespec's adapter contract alone.

`my_llm` stands for your engine's Python API (the tests run this file as it is over a small
engine of that name: tests/contract_engine/my_llm.py). `make` is called once per forced
checkpoint (`decodespec checkpoints build --out ckpts`); the adapter sends every field of the
case's request and refuses, as n/a, one the engine does not take.
"""

import my_llm

from decodespec.properties.conformance.contract import (
    Answer,
    Checkpoint,
    Choice,
    Chunk,
    Request,
    TokenReport,
    ToolCall,
    Unsupported,
    Usage,
)

TAKES = ("min_tokens", "ignore_eos", "logit_bias", "echo", "skip_special_tokens", "include_stop_str_in_output")
CHAT = ("tools", "chat_template_kwargs")


class MyEngine:
    name = "my-engine"

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.llm = my_llm.LLM(checkpoint.folder, max_model_len=checkpoint.context_length)
        self.context_length = self.llm.max_model_len  # the context it runs with: the context-limit cases

    def _prompt(self, req: Request) -> list[int]:
        if not req.chat:
            return list(req.prompt)
        kwargs = req.fields.get("chat_template_kwargs") or {}
        return self.llm.render_chat([dict(m) for m in req.messages], tools=req.fields.get("tools"), **kwargs)

    def _params(self, req: Request) -> my_llm.SamplingParams:
        if req.fields.get("temperature", 0) != 0:
            raise Unsupported("my-engine decodes greedily only")
        takes = TAKES + (CHAT if req.chat else ())
        if unknown := sorted(set(req.fields) - {"temperature", *takes}):
            raise Unsupported(f"the request field(s) {unknown}")
        fields = {k: v for k, v in req.fields.items() if k in TAKES}
        return my_llm.SamplingParams(max_tokens=req.max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                                     n=req.n, **fields)

    @staticmethod
    def _tokens(pairs: list[tuple[int, float]]) -> tuple[TokenReport, ...]:
        return tuple(TokenReport(id=tid, logprob=lp) for tid, lp in pairs)

    def complete(self, req: Request) -> Answer:
        ids = self._prompt(req)
        out = self.llm.generate(ids, self._params(req), channels=req.chat, tools=bool(req.fields.get("tools")))
        choices = tuple(
            Choice(text=o.text, finish_reason=o.finish_reason, index=o.index, tokens=self._tokens(o.tokens),
                   reasoning=o.reasoning,
                   tool_calls=None if o.tool_calls is None else
                   tuple(ToolCall(name, args, i) for i, (name, args) in enumerate(o.tool_calls)))
            for o in out.outputs)
        return Answer(choices=choices, usage=Usage(len(ids), out.completion_tokens))

    def stream(self, req: Request):
        ids = self._prompt(req)
        n = 0
        for d in self.llm.generate_stream(ids, self._params(req), channels=req.chat,
                                          tools=bool(req.fields.get("tools"))):
            n += len(d.tokens)
            calls = tuple(ToolCall(name, args, i) for i, name, args in d.tool_calls)
            yield Chunk(text=d.text, index=d.index, finish_reason=d.finish_reason, tokens=self._tokens(d.tokens),
                        reasoning=d.reasoning, tool_calls=calls,
                        selected=d.selected)  # the ids selected since the last chunk: hold-back is judged
        yield Chunk(usage=Usage(len(ids), n))


def make(checkpoint: Checkpoint) -> MyEngine:
    return MyEngine(checkpoint)
