"""Compile script cases into forced checkpoints that any engine can load.

Cases are grouped by tokenizer: inline byte tables that agree on every shared id merge into one
byte-level BPE tokenizer whose ids are the tables' own ids (so a case's script ids are the
checkpoint's), and each fixture tokenizer (properties/fixtures.py) is used as it is. Every case
of a group gets a marker (an added special token) that opens its prompt, followed by the group's
anchor token; `forced.forced_llama` then sets a one-layer Llama's weights so that greedy decoding
from `[marker, anchor] + prompt` yields the case's script, in float32, bfloat16 and float16, and
whatever an engine puts in front of the prompt. Every checkpoint also carries the prefix probe
(forced.Probe): its marker alone as a prompt answers one digit, the number of tokens the engine put
in front (script_check.detect_prefix reads it). A group folder holds a plain transformers
checkpoint (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json) and `decodespec-checkpoint.json`, the manifest: for each case id, its
marker, prompt ids and script ids; the anchor, the probe, and the margins measured per dtype. The
manifest is the mapping from case to request; engines never see the case files.

`prove(folder)` runs transformers `generate` greedily on every program of a checkpoint, and on the
probe, in each dtype, the model loaded with the head size taken as hidden / heads (as loaders that
ignore `head_dim` do), and raises unless each yields its script exactly: no engine is judged on an
unproved checkpoint.

Expected results over HTTP come from the reference loop (`generate()` with `ScriptedModel`) on
the checkpoint's own tokenizer and the case's script, never from a fixture's text, so a correct
engine passes whatever the tokenizer (`reference_outcome`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from ...runtime.result import Result
from ...runtime.tokenizers import BYTE_LEVEL, HFTokenizer
from ...runtime.tokenizers import Tokenizer as RuntimeTokenizer  # tokenizers.Tokenizer is the library's
from .adapters.base import case_prompt, case_script, fixture_tokenizer, reference_on, table_tokenizer
from .cases import Case, CaseError, CaseKind
from .chat_cases import TAGS, TEMPLATES, TOOLS, chat_of, chat_variants, template_of
from .forced import CONTEXT, DTYPES, PROBE_MAX, Probe, Program, check_margins, forced_llama
from .symptoms import first_difference

MANIFEST = "decodespec-checkpoint.json"
# The recipe program: varied free text (multi-byte characters included) that the black-box recipes
# cut their probes from, then EOS, so they need no natural-language model.
RECIPE = "recipe"
RECIPE_TEXT = "Once upon a time, a café in 東京 served tea; the end."
# The long program: a script of LONG_TOKENS plain ASCII tokens, then EOS, that the
# request-life recipes (properties/conformance/life) stream, cut, resume and run side by side. Its
# tokens repeat hundreds of times, so unlike every other program it holds under no frequency
# penalty; and its proof costs more than the rest together, so a build for the script cases alone
# leaves it out (build_group's `long`): the request-life cases are then n/a, saying so.
LONG = "long"
LONG_TOKENS = 480
# Programs of a checkpoint that no case owns.
OWNLESS = frozenset({RECIPE, LONG})
SHORT_RUN = 128  # proof runs up to this many tokens share one batch; longer ones have their own
FORMAT = "decodespec-forced/2"
TABLE_GROUP = "byte_table"
ANCHOR = "<|decodespec-anchor|>"
PROBE = "<|decodespec-probe|>"
# The probe's answers, in order: the first of these characters that the tokenizer spells with one token.
ECHO_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_CHAR_OF_BYTE = {b: c for c, b in BYTE_LEVEL.items()}

# Why a script case cannot run against a black box, by the input that needs the engine's inside.
HTTP_BLOCKERS = {
    "faults": "it injects a fault inside the engine at a given step (cancel, deadline, model error, "
              "transport); an HTTP server offers no such hook",
}
# Invariants a black box can show broken: through its text, its SSE deltas, finish_reason and usage.
HTTP_OBSERVABLE = frozenset({
    "stop_bytes_never_emitted", "nothing_after_stop_hit", "stop_reason_requires_hit", "eos_not_emitted",
    "finish_reason_matches_state", "length_respected", "usage_consistent", "detok_concat_equals_batch",
    "delta_nonempty", "single_terminal_event", "no_delta_after_terminal", "terminal_after_all_deltas",
    "eos_guards_respected",  # a guarded EOS (min_tokens, ignore_eos) shows as text that goes on
    "stream_tokens_aligned",  # per-token logprobs / token ids against each chunk's text (D59)
    # The chat answer's channels (machine/checker_channels.INVARIANTS): its content, reasoning and calls.
    "pieces_once", "reasoning_is_bracketed", "think_tags_never_text", "calls_only_when_closed", "calls_end_as_calls",
})


def http_blocker(case: Case) -> str | None:
    """Why `case` cannot run over HTTP on a forced checkpoint, or None when it can."""
    if case.kind is not CaseKind.SCRIPT:
        return "it is a black-box recipe, not a script case"
    for key, why in HTTP_BLOCKERS.items():
        if case.inputs.get(key):
            return why
    if case.invariant not in HTTP_OBSERVABLE:
        return (f"its invariant {case.invariant} concerns the engine's internal events, which a black box "
                "does not expose")
    long_ids = [s for s in case.inputs.get("stop_token_ids", ()) if len(s) != 1]
    if long_ids:
        return (f"it stops on the token-id sequence(s) {long_ids}; OpenAI-compatible servers take single "
                "stop_token_ids only")
    return None


# ---- tokenizers ----------------------------------------------------------------------------------


def group_of(case: Case) -> str:
    """The checkpoint a case compiles into: its tokenizer's, and for a chat case its template's."""
    base = case.fixture or TABLE_GROUP
    return f"{base}-{template_of(case)}" if chat_of(case) is not None else base


def with_chat(cases: Iterable[Case]) -> list[Case]:
    """The cases and the chat variant of every HTTP-runnable one (chat_cases.chat_variants)."""
    cases = list(cases)
    return cases + chat_variants(cases, lambda c: http_blocker(c) is None)


def merged_table(cases: Iterable[Case]) -> tuple[dict[int, bytes], int | None]:
    """The union of the cases' byte tables; a CaseError names two cases that disagree."""
    table: dict[int, bytes] = {}
    owner: dict[int, str] = {}
    eos: tuple[int | None, str] | None = None
    for case in cases:
        spec = case.tokenizer_spec
        tok = table_tokenizer(spec)
        if eos is not None and eos[0] != tok.eos_id:
            raise CaseError(f"{case.id}: eos {tok.eos_id} differs from {eos[1]}'s {eos[0]}; they cannot share a checkpoint")
        eos = (tok.eos_id, case.id)
        for tid in map(int, spec["table"]):
            data = tok.token_bytes(tid)
            if table.setdefault(tid, data) != data:
                raise CaseError(f"{case.id}: id {tid} is {data!r} but {table[tid]!r} in {owner[tid]}")
            owner.setdefault(tid, case.id)
    if eos is None:
        raise CaseError("no byte-table case to build a tokenizer from")
    return table, eos[0]


def byte_table_tokenizer(table: Mapping[int, bytes], eos_id: int | None, markers: Sequence[str]) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` with the table's ids and bytes, plus the markers.

    Single-byte entries are the byte tokens themselves; the bytes the table lacks fill the free ids
    from 0 up, so every byte has a token and ids are contiguous. EOS (and each marker) is a special
    added token.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    def chars(data: bytes) -> str:
        return "".join(_CHAR_OF_BYTE[b] for b in data)

    vocab: dict[str, int] = {}
    for tid, data in sorted(table.items()):
        if not data:
            raise CaseError(f"table id {tid} has no bytes")
        if chars(data) in vocab:
            raise CaseError(f"table ids {vocab[chars(data)]} and {tid} both spell {data!r}")
        vocab[chars(data)] = tid
    free = (i for i in range(1 << 20) if i not in table)
    for b in range(256):
        if chars(bytes([b])) not in vocab:
            vocab[chars(bytes([b]))] = next(free)
    size = max(vocab.values()) + 1
    for gap in sorted(set(range(size)) - set(vocab.values())):
        vocab[f"<unused{gap}>"] = gap  # never scripted: keeps ids contiguous for GGUF converters
    # Two-byte entries get their merge (llama.cpp refuses a BPE vocabulary without merges); longer
    # ones are reachable by id only, which is how prompts and scripts name them.
    merges = [(chars(d[:1]), chars(d[1:])) for _, d in sorted(table.items()) if len(d) == 2]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if eos_id is not None:
        tok.add_special_tokens([AddedToken(chars(table[eos_id]), special=True, normalized=False)])
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    return tok


def _group_tokenizer(group: str, cases: Sequence[Case], markers: Sequence[str]) -> tuple[Any, str]:
    """The group's tokenizer with the markers added, and its EOS token's text; a chat group's also
    has its template's special tokens, and the reasoning and tool-call tags as added tokens that are
    text (as Qwen3's are), where the vocabulary has no token spelling them."""
    from tokenizers import AddedToken

    chat = chat_of(cases[0]) if cases else None
    if chat is None:
        return _base_tokenizer(group, cases, markers)
    tok, eos_text = _base_tokenizer(group.rsplit("-", 1)[0], cases, [*TEMPLATES[template_of(cases[0])].special, *markers])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS if tok.token_to_id(t) is None])
    return tok, eos_text


def _base_tokenizer(group: str, cases: Sequence[Case], markers: Sequence[str]) -> tuple[Any, str]:
    from tokenizers import AddedToken, Tokenizer

    if group == TABLE_GROUP:
        table, eos = merged_table(cases)
        if eos is None:
            raise CaseError("the byte-table cases declare no eos; a forced checkpoint needs one")
        tok = byte_table_tokenizer(table, eos, markers)
        return tok, tok.id_to_token(eos)
    base = fixture_tokenizer(group)
    tok = Tokenizer.from_file(str(base.path))
    if base.eos_id is None or (eos_text := tok.id_to_token(base.eos_id)) is None:
        raise CaseError(f"fixture tokenizer {group} has no eos")
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    return tok, eos_text


def _id_of(tok: Any, text: str) -> int:
    """The id of the added token `text` in a group's tokenizer (`tokenizers.Tokenizer`); a CaseError
    where it has none."""
    tid = tok.token_to_id(text)
    if tid is None:
        raise CaseError(f"the group's tokenizer has no token {text!r}")
    return int(tid)


def _marker(i: int) -> str:
    return f"<|decodespec-case-{i}|>"


def echo_tokens(tok: HFTokenizer, eos_id: int) -> list[int]:
    """PROBE_MAX + 1 ids that each spell one character of ECHO_ALPHABET alone, in that order."""
    out = []
    for ch in ECHO_ALPHABET:
        ids = tok.encode(ch)
        if len(ids) == 1 and ids[0] not in tok.special_ids and ids[0] != eos_id and tok.decode(ids) == ch:
            out.append(ids[0])
        if len(out) == PROBE_MAX + 1:
            return out
    raise CaseError(f"{tok.path}: only {len(out)} characters of {ECHO_ALPHABET!r} are single tokens; the prefix "
                    f"probe needs {PROBE_MAX + 1}")


def long_script(tok: HFTokenizer) -> list[int]:
    """LONG_TOKENS ids of numbered ASCII words (every tokenizer spells them, none ends a character
    early), so a long stream's text says where it was cut."""
    words = " ".join(f"w{i:03d}" for i in range(LONG_TOKENS))
    ids = tok.encode(words)[:LONG_TOKENS]
    if len(ids) < LONG_TOKENS:
        raise CaseError(f"{tok.path}: the long program's text gives only {len(ids)} tokens")
    return ids


# ---- building and proving -------------------------------------------------------------------------


class ScriptPrograms(Protocol):
    """What judging a script case reads of the checkpoint it runs on: the group's name, each case's
    program (case id -> Program), the tokenizer whose ids they are, the EOS id, and each chat case's
    templated prompt (`chat`). A built Checkpoint is one; so is a case's own program, which a
    recording is judged on (adapters/recorded.CaseProgram)."""

    @property
    def group(self) -> str: ...

    @property
    def programs(self) -> Mapping[str, Program]: ...

    @property
    def tokenizer(self) -> RuntimeTokenizer: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def chat(self) -> Mapping[str, Mapping[str, Any]]: ...


@attrs.frozen
class Checkpoint:
    """A built group: its folder and programs (case id -> Program)."""

    folder: Path
    group: str
    eos_id: int
    programs: Mapping[str, Program]
    anchor: int
    probe: Probe
    margins: Mapping[str, Mapping[str, Any]]  # dtype -> the Margin's fields, as check_margins measured them
    chat: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)  # chat case id -> message, ids, prompt_tokens

    @classmethod
    def load(cls, folder: str | Path) -> Checkpoint:
        folder = Path(folder)
        path = folder / MANIFEST
        if not path.is_file():
            raise CaseError(f"{folder} is not a forced checkpoint: {MANIFEST} is missing "
                            "(build one with `decodespec checkpoints build`)")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CaseError(f"{path}: not JSON ({exc}); rebuild it with `decodespec checkpoints build`") from None
        if not isinstance(data, dict):
            raise CaseError(f"{path}: a JSON {type(data).__name__} where the manifest is an object; rebuild it "
                            "with `decodespec checkpoints build`")
        if data.get("format") != FORMAT:
            raise CaseError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r} (rebuild it with "
                            "`decodespec checkpoints build`)")
        try:
            programs = {cid: Program(cid, p["marker"], p["prompt"], p["script"]) for cid, p in data["cases"].items()}
            probe = Probe(data["probe"]["marker"], data["probe"]["echo"])
            return cls(folder, data["group"], data["eos_id"], programs, data["anchor"], probe, data["margins"],
                       data.get("chat", {}))
        except (KeyError, TypeError, AttributeError) as exc:  # a manifest cut or edited by hand
            raise CaseError(f"{path}: not a {FORMAT} manifest ({type(exc).__name__}: {exc}); rebuild it with "
                            "`decodespec checkpoints build`") from None

    @property
    def tokenizer(self) -> HFTokenizer:
        return _tokenizer(self.folder)


def checkpoint_folders(folder: str | Path) -> list[Path]:
    """The forced checkpoints at `folder`: itself when it is one, else the ones one level down."""
    root = Path(folder)
    return [root] if (root / MANIFEST).is_file() else sorted(p.parent for p in root.glob(f"*/{MANIFEST}"))


def load_set(folder: str | Path) -> dict[str, Checkpoint]:
    """case id -> its Checkpoint, for one checkpoint folder or a folder of them (a built set)."""
    found = checkpoint_folders(folder)
    if not found:
        raise CaseError(f"{folder} holds no forced checkpoint ({MANIFEST}); build them with `decodespec checkpoints build`")
    out: dict[str, Checkpoint] = {}
    for f in found:
        ck = Checkpoint.load(f)
        out.update({cid: ck for cid in ck.programs if cid not in OWNLESS})
    return out


def is_forced(folder: str | Path) -> bool:
    """Whether `folder` is a forced checkpoint or a folder of them."""
    return Path(folder).is_dir() and bool(checkpoint_folders(folder))


def digest(folder: str | Path) -> str:
    """A checkpoint's content hash: sha256 over its files (names and bytes, sorted; logs left out),
    so a reproducer names exactly the weights and tokenizer a verdict was given on."""
    h = hashlib.sha256()
    root = Path(folder)
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix in (".json", ".safetensors"):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


@functools.cache
def _tokenizer(folder: Path) -> HFTokenizer:
    return HFTokenizer(folder)


def served_context(case: Case, ckpt: ScriptPrograms) -> int | None:
    """The context length a server needs for `case`'s context limit on this checkpoint: the case's own,
    widened by the tokens the server's prompt puts before the case's prompt (the program's marker and
    anchor; on the chat endpoint the chat template's tokens too, as transformers counts the templated
    prompt), so the case keeps its meaning (the same output tokens before the limit); None for a case
    without one."""
    if "context_limit" not in case.inputs:
        return None
    chat = ckpt.chat.get(case.id)
    served = int(chat["prompt_tokens"]) if chat else len(ckpt.programs[case.id].prompt)
    return int(case.inputs["context_limit"]) + served - len(case_prompt(case, ckpt.tokenizer))


def on_checkpoint(case: Case, ckpt: ScriptPrograms) -> Case:
    """`case` as the reference runs it on the checkpoint's program (whose prompt is the marker, the
    anchor and the case's prompt, the template left out): its context limit widened by the program's
    tokens before the case's prompt, so as many output tokens fit as on the served context, and its
    max_tokens kept within that context (servers refuse a budget larger than the whole context, vLLM
    among them; the limit still ends the run first, so the answer is the same)."""
    if "context_limit" not in case.inputs:
        return case
    n = int(case.inputs["context_limit"]) + len(ckpt.programs[case.id].prompt) - len(case_prompt(case, ckpt.tokenizer))
    return attrs.evolve(case, inputs={**case.inputs, "context_limit": n, "max_tokens": min(case.max_tokens, n)})


def reference_result(case: Case, ckpt: ScriptPrograms) -> Result:
    """The reference loop on the checkpoint's tokenizer, forcing the case's compiled script."""
    prog = ckpt.programs[case.id]
    return reference_on(on_checkpoint(case, ckpt), ckpt.tokenizer, prog.prompt, prog.script)


def build_group(group: str, cases: Sequence[Case], folder: Path, *, long: bool = True) -> Checkpoint:
    """Write one group's checkpoint into `folder` (replaced if present) and return it; with `long`
    it carries the long program too (the request-life cases need it)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    cases = sorted(cases, key=lambda c: c.id)
    markers = [_marker(i) for i in range(len(cases))]
    recipe_marker, long_marker = _marker(len(cases)), _marker(len(cases) + 1)
    tok, eos_text = _group_tokenizer(group, cases, [*markers, recipe_marker, long_marker, ANCHOR, PROBE])
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save(str(tmp / "tokenizer.json"))
    eos_id = tok.token_to_id(eos_text)
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_text, "bos_token": None, "pad_token": eos_text,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT,
        **_special_config(group, eos_text),
        **_chat_config(cases),
    }, indent=2) + "\n")
    hf = HFTokenizer(tmp)
    rt = Tokenizer.from_file(str(tmp / "tokenizer.json"))
    anchor = _id_of(rt, ANCHOR)
    programs = []
    chat: dict[str, dict[str, Any]] = {}
    for case, marker in zip(cases, markers):
        mid = _id_of(rt, marker)
        prompt = [mid, anchor, *case_prompt(case, hf)]
        if (asked := chat_of(case)) is not None:  # the program's prompt is the template's, from the marker on
            chat[case.id] = templated(tmp, marker + ANCHOR + hf.decode(prompt[2:]), mid,
                                      TOOLS if asked.get("tools") else None)
            prompt = chat[case.id]["ids"][chat[case.id]["ids"].index(mid):]
        programs.append(Program(case.id, mid, prompt, case_script(case, hf)))
    mid = _id_of(rt, recipe_marker)
    programs.append(Program(RECIPE, mid, [mid, anchor], [*hf.encode(RECIPE_TEXT), eos_id]))
    if long:
        mid = _id_of(rt, long_marker)
        programs.append(Program(LONG, mid, [mid, anchor], [*long_script(hf), eos_id]))
    probe = Probe(_id_of(rt, PROBE), echo_tokens(hf, eos_id))
    config, state = forced_llama(programs, rt.get_vocab_size(with_added_tokens=True), eos_id, anchor, probe)
    margins = check_margins(state, config, programs, eos_id, probe)
    save_file({k: torch.from_numpy(v) for k, v in state.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}, indent=2) + "\n")
    manifest = {
        "format": FORMAT, "group": group, "eos_id": eos_id, "anchor": anchor,
        "probe": {"marker": probe.marker, "echo": list(probe.echo)},
        "margins": {d: {"logit": round(m.logit, 3), "gate": round(m.gate, 3), "steps": m.steps, "where": m.where}
                    for d, m in margins.items()},
        "cases": {p.name: {"marker": p.marker, "prompt": list(p.prompt), "script": list(p.script)} for p in programs},
        "chat": chat,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return Checkpoint.load(folder)


def _special_config(group: str, eos_text: str) -> dict[str, Any]:
    """tokenizer_config.json's names for the fixture's own special tokens besides its EOS (its model's
    unk_token, the rest as extra_special_tokens), so that every engine's tokenizer treats as special
    what tokenizer.json flags special: llama.cpp's converter types a token CONTROL only when the HF
    tokenizer lists it among its special ids, and a NORMAL '<unk>' would be sent as its text where a
    special token is none under skip_special_tokens (§4.5, D33). A byte table has no other."""
    from tokenizers import Tokenizer

    base = group.split("-", 1)[0]
    if base == TABLE_GROUP:
        return {}
    path = fixture_tokenizer(base).path
    own = [t.content for _, t in sorted(Tokenizer.from_file(str(path)).get_added_tokens_decoder().items())
           if t.special and t.content != eos_text]
    unk = json.loads(Path(path).read_text(encoding="utf-8"))["model"].get("unk_token")
    extra = [t for t in own if t != unk]
    return {**({"unk_token": unk} if unk in own else {}), **({"extra_special_tokens": extra} if extra else {})}


def _chat_config(cases: Sequence[Case]) -> dict[str, Any]:
    """tokenizer_config.json's chat fields: a chat group's template (and its BOS); any other group's
    chat endpoint renders the first message verbatim (its content starts with the marker)."""
    if not cases or chat_of(cases[0]) is None:
        return {"chat_template": "{{ messages[0]['content'] }}"}
    t = TEMPLATES[template_of(cases[0])]
    return {"chat_template": t.source, **({"bos_token": t.bos} if t.bos else {})}


def templated(folder: Path, message: str, marker: int, tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The ids transformers' `apply_chat_template` makes of one user message on the checkpoint's
    own files (what vLLM renders, and what usage.prompt_tokens must count), with `tools` as the
    request offers them (chat.request_body sends chat_cases.TOOLS for a tool case: the template
    lists them in a system turn before the message)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    out = tok.apply_chat_template([{"role": "user", "content": message}],
                                  tools=None if tools is None else [dict(t) for t in tools],
                                  add_generation_prompt=True, tokenize=True)
    if isinstance(out, str):
        raise CaseError(f"{folder.name}: apply_chat_template gave text where token ids were asked for")
    ids = list(out["input_ids"] if not isinstance(out, list) else out)
    if marker not in ids:
        raise CaseError(f"{folder.name}: the chat template dropped the marker from {message!r}")
    return {"message": message, "ids": ids, "prompt_tokens": len(ids)}


def build_checkpoints(cases: Iterable[Case], out: str | Path, *, chat: bool = True, long: bool = True) -> list[Checkpoint]:
    """One checkpoint per tokenizer group of the HTTP-runnable script cases and, with `chat`, of
    their chat variants (one per template: with_chat), under `out/<group>`; `long`: build_group's."""
    groups: dict[str, list[Case]] = {}
    for case in (with_chat(cases) if chat else cases):
        if http_blocker(case) is None:
            groups.setdefault(group_of(case), []).append(case)
    if not groups:
        raise CaseError("none of the selected cases can run over HTTP; nothing to build")
    return [build_group(g, cs, Path(out) / g, long=long) for g, cs in sorted(groups.items())]


class ProofError(AssertionError):
    """transformers did not follow a program of a forced checkpoint."""


def generate_batch(model: Any, prompts: Sequence[Sequence[int]], n: int, pad_id: int, **kw: Any) -> list[list[int]]:
    """transformers `generate` on every prompt at once (left-padded, masked), greedy unless `kw` says
    otherwise, for n new tokens each (no EOS stops it); the new ids of each."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, eos_token_id=None, pad_token_id=pad_id, **kw)
    return out[:, width:].tolist()


def proof_runs(ckpt: Checkpoint) -> list[tuple[str, list[int], list[int]]]:
    """(name, prompt, ids greedy must produce) for every program (a chat one on its templated prompt)
    and for the probe, bare and behind a BOS."""
    runs = [(p.name, list(ckpt.chat[p.name]["ids"]) if p.name in ckpt.chat else list(p.prompt), [*p.script, ckpt.eos_id])
            for p in ckpt.programs.values()]  # a chat program on its whole templated prompt
    for shift in (0, 1):
        runs.append((f"probe behind {shift}", [ckpt.eos_id] * shift + list(ckpt.probe.prompt),
                     [ckpt.probe.echo[shift], ckpt.eos_id]))
    return runs


def load_llama(folder: Path, dtype: str) -> Any:
    """transformers' LlamaForCausalLM in `dtype` from the checkpoint with config.json's `head_dim` left
    out, so the head size is hidden / heads as loaders that ignore `head_dim` take it (D25); a
    checkpoint whose heads x head_dim is not hidden is a ProofError naming the shapes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.pop("head_dim", None)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if hidden % heads:
        raise ProofError(f"{folder.name}: hidden size {hidden} is not a multiple of its {heads} heads; a Llama "
                         "loader that takes the head size as hidden / heads refuses it")
    try:
        model = LlamaForCausalLM.from_pretrained(folder, config=LlamaConfig(**config), dtype=getattr(torch, dtype))
    except RuntimeError as exc:  # transformers' refusal of a weight whose shape differs from the config's
        raise ProofError(f"{folder.name}: a Llama loader that takes the head size as hidden / heads ({hidden} / "
                         f"{heads}) refuses its weights: {str(exc).splitlines()[0]}") from None
    return model.eval()


def prove(ckpt: Checkpoint, dtypes: Sequence[str] = DTYPES) -> str:
    """Greedy transformers `generate` in each dtype on every program must give its script, then EOS,
    and the probe its echo of the prefix (none, a BOS), the model loaded with the head size taken as
    hidden / heads (`load_llama`).

    Returns a one-line account (programs, tokens, dtypes, transformers version); raises ProofError
    naming the dtype and the first program that deviates, and where, or the weights such a loader
    refuses.
    """
    import transformers

    runs = proof_runs(ckpt)
    # The long program generates alone: in one batch every run would be as long as it (on CPU in half
    # precision, several times the cost of everything else).
    batches = [b for b in ([r for r in runs if len(r[2]) <= SHORT_RUN], [r for r in runs if len(r[2]) > SHORT_RUN]) if b]
    for dtype in dtypes:
        model = load_llama(ckpt.folder, dtype)
        got = [ids for b in batches for ids in generate_batch(model, [prompt for _, prompt, _ in b],
                                                               max(len(want) for _, _, want in b), ckpt.eos_id)]
        for (name, _, want), ids in zip([r for b in batches for r in b], got):
            if ids[:len(want)] != want:
                at = first_difference(ids, want)
                raise ProofError(f"{ckpt.folder.name} in {dtype}: {name} generated {ids[:len(want)]}, expected {want} "
                                 f"(first difference at output token {at + 1})")
    tokens = sum(len(want) for _, _, want in runs)
    return (f"{ckpt.group}: {len(ckpt.programs)} programs and the prefix probe, {tokens} tokens followed exactly by "
            f"transformers {transformers.__version__} generate (greedy, head size hidden / heads) in "
            f"{', '.join(dtypes)}")
