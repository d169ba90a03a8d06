"""What a chat case is: its settings, the chat templates its checkpoints carry, the tool
the tool-call cases offer, and the chat variants of the completions script cases.

Data only, below both the checkpoint builder (checkpoints.py places the templated prompts) and the
chat runner (chat.py judges the answers), so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ...runtime.channels import CALL, THINK
from .cases import Case

TAGS = (*THINK, *CALL)


@attrs.frozen
class Template:
    """A chat template and the special tokens it needs in the vocabulary (`bos`: its BOS token)."""

    source: str
    special: tuple[str, ...]
    bos: str | None = None


# "chatml" is Qwen-style ChatML with Hermes tool calls, so that servers which derive their reasoning
# and tool-call parsers from how the template renders (llama.cpp's differential autoparser,
# common/chat-diff-analyzer.cpp) find `<think>`...`</think>` and `<tool_call>{json}</tool_call>`:
# with `tools` a system turn lists them (names only: no `tojson` of the request's tools, whose key
# order and escaping differ between transformers, jinja2 and llama.cpp), an assistant turn renders
# its reasoning_content and tool_calls exactly as the forced scripts emit them (no newlines inside
# the tags). One user message without tools renders as plain ChatML. Every piece is an expression,
# so no engine's trim_blocks/lstrip_blocks setting changes the text.
CHATML = (
    r"{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>\n' }}"
    r"""{%- for tool in tools %}{{- '{"name": "' + tool.function.name + '"}\n' }}{%- endfor %}"""
    r"""{{- '</tools>\nCall one as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>\n' }}"""
    r"{%- endif %}"
    r"{%- for m in messages %}"
    r"{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}"
    r"{%- if m.reasoning_content %}{{- '<think>' }}{{- m.reasoning_content }}{{- '</think>' }}{%- endif %}"
    r"{%- if m.content %}{{- m.content }}{%- endif %}"
    r"{%- if m.tool_calls %}{%- for call in m.tool_calls %}"
    r"{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    r"""{{- '<tool_call>{"name": "' + call.name + '", "arguments": ' }}"""
    r"{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    r"{{- '}</tool_call>' }}{%- endfor %}{%- endif %}"
    r"{{- '<|im_end|>\n' }}"
    r"{%- else %}{{- '<|im_start|>' + m.role + '\n' }}{{- m.content }}{{- '<|im_end|>\n' }}{%- endif %}"
    r"{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
TEMPLATES: Mapping[str, Template] = {
    "chatml": Template(CHATML, ("<|im_start|>", "<|im_end|>")),
    "bos": Template(
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|begin_of_text|>"),
}
# The tool the tool-call cases offer (any schema: the forced script decides the call).
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def chat_of(case: Case) -> Mapping[str, Any] | None:
    """The case's chat settings, or None for a completions case."""
    chat = case.inputs.get("chat")
    return chat if isinstance(chat, Mapping) else None


def template_of(case: Case) -> str:
    chat = chat_of(case) or {}
    return chat.get("template", "chatml")


def chat_variants(cases: Iterable[Case], runnable: Any) -> list[Case]:
    """`chat/<id>` (ChatML) of every case `runnable(case)` accepts that is not a chat case already,
    and `chat-bos/<id>` of the byte-table ones (their tokenizer holds every byte). Cases that ask
    for what a chat request has not (`echo`) or judge several choices (`n`) stay completions cases."""
    from ...runtime.openai_schema import FIELDS

    out = []
    for case in cases:
        fields = case.inputs.get("request", {})
        if chat_of(case) is not None or not runnable(case) or set(fields) - set(FIELDS[True]) \
                or fields.get("n", 1) != 1:
            continue
        for template, prefix in (("chatml", "chat"), ("bos", "chat-bos")):
            if template == "bos" and case.fixture:
                continue
            out.append(attrs.evolve(case, id=f"{prefix}/{case.id}", inputs={**case.inputs, "chat": {"template": template}},
                                    path=None))
    return out
