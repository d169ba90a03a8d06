"""What a chat case is (issue 25): its settings, the chat templates its checkpoints carry, the tool
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


TEMPLATES: Mapping[str, Template] = {
    "chatml": Template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        ("<|im_start|>", "<|im_end|>")),
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
