"""Engine presets: how `decodespec conform --preset NAME` judges an engine in one command.

The presets are data, presets.toml beside this module (its header documents the format; `--presets
FILE` adds more in the same format). A preset names the engine's launch, context and tight commands
(launch.run_launched starts one server per forced checkpoint with them), the GGUF conversion a
llama.cpp engine needs, what the engine lacks (`without`), the choices its documentation states on
this project's decisions (`declare`, applied as `--declare`, D69), the cases it runs and its jobs. This
module reads and checks them, finds the engine's program on PATH (a missing one is one error naming
what to install), and prepares the checkpoints a run serves: built once per set of cases
(checkpoints.build_checkpoints, cached by the content of what decides them) and converted to GGUF
by llama.cpp's converter where the preset asks for it.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import string
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from .cases import CASES_DIR, Case, CaseKind
from .chat_cases import chat_of
from .decisions import DECISIONS
from .without import WITHOUT

FORMAT = 1
PRESETS_FILE = Path(__file__).with_name("presets.toml")
CASE_SETS: Mapping[str, Callable[[Case], bool]] = {
    "chapter": lambda case: chat_of(case) is None,
    "chat": lambda case: chat_of(case) is not None,
    "all": lambda case: True,
}
GGUF_FILES = {"f32": "model.gguf", "f16": "model-f16.gguf", "bf16": "model-bf16.gguf"}
# field -> (type, default); a field without a default is required (after `extends`)
FIELDS: Mapping[str, tuple[type, Any]] = {
    "engine": (str, None), "install": (str, None), "launch": (str, None), "cases": (str, None),
    "context": (str, ""), "tight": (str, ""), "gguf": (str, ""), "without": (list, []), "declare": (list, []),
    "jobs": (int, 1), "model": (str, ""), "aliases": (list, []), "note": (str, ""), "extends": (str, ""),
    "worker": (list, []),
}
NOT_INHERITED = frozenset({"aliases", "extends"})
# What launch.launched fills in per server, and what each command may use besides.
SERVER_FIELDS = frozenset({"model", "gguf", "name", "port"})
TEMPLATE_FIELDS: Mapping[str, frozenset[str]] = {
    "launch": SERVER_FIELDS, "context": SERVER_FIELDS | {"context"}, "tight": SERVER_FIELDS,
    "model": frozenset({"model", "name"}),
}
_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHONS = frozenset({"python", "python3"})
# What decides a built set of checkpoints (set_stamp; scripts/peers/checkpoints.sh asks
# `decodespec checkpoints stamp`): the cases, the construction, the chat templates and tool list, the
# reasoning and tool tags, the fixtures.
_HERE = Path(__file__).resolve().parent
STAMP_SOURCES = (CASES_DIR, _HERE / "forced.py", _HERE / "checkpoints.py", _HERE / "chat_cases.py",
                 _HERE.parent.parent / "runtime" / "channels.py", _HERE.parent / "fixtures.py")


class PresetError(ValueError):
    """A preset that is unknown, malformed, or whose engine or converter cannot be found."""


@attrs.frozen
class Converter:
    """The GGUF converter ([gguf] of presets.toml): `command` with {model}, {out}, {outtype}; the
    environment variable `source` names the llama.cpp checkout it runs from."""

    command: str
    source: str
    install: str

    def argv(self, model: Path, out: Path, outtype: str) -> list[str]:
        """The command to run, its `python` the interpreter running decodespec."""
        words = shlex.split(self.command.format(model=model, out=out, outtype=outtype))
        return [sys.executable, *words[1:]] if words[0] in PYTHONS else words

    def shown(self, model: str, out: str, outtype: str) -> str:
        """The command as a reader pastes it."""
        return self.command.format(model=model, out=out, outtype=outtype)


@attrs.frozen
class Preset:
    """One engine's preset, resolved (`extends` applied, {launch} filled in); see presets.toml."""

    name: str
    engine: str
    install: str
    launch: str
    context: str
    tight: str
    gguf: str
    without: tuple[str, ...]
    declare: tuple[str, ...]
    jobs: int
    model: str
    cases: str
    aliases: tuple[str, ...]
    note: str
    worker: tuple[str, ...]  # a gateway's: the worker's reports judged directly (attribution.py)

    @property
    def gguf_file(self) -> str | None:
        """The GGUF file name beside a checkpoint's files, for llama.cpp engines."""
        return GGUF_FILES[self.gguf] if self.gguf else None

    def runs(self, case: Case) -> bool:
        """Whether `case` is among the preset's cases (chapter, chat or all)."""
        return CASE_SETS[self.cases](case)

    def program(self) -> tuple[str, str | None]:
        """The program the launch command runs (its leading VAR=value words skipped) and, when it is
        `python -m MODULE`, the module."""
        words = shlex.split(self.launch)
        rest = words[next(i for i, w in enumerate(words) if not _ENV_WORD.match(w)):]
        module = rest[2] if rest[0] in PYTHONS and rest[1:2] == ["-m"] and len(rest) > 2 else None
        return rest[0], module

    def missing(self, path: str) -> str | None:
        """Why the engine cannot start with `path` as PATH, naming what to install; None when it can."""
        prog, module = self.program()
        found = shutil.which(prog, path=path)
        if found is None:
            return f"preset {self.name} runs `{prog}`, which is not on PATH. Install it: {self.install}"
        if module is not None:
            probe = f"import importlib.util as u, sys; sys.exit(u.find_spec({module!r}) is None)"
            if subprocess.run([found, "-c", probe], capture_output=True, timeout=60).returncode != 0:
                return (f"preset {self.name} runs `{prog} -m {module}`, which {found} (the first `{prog}` on "
                        f"PATH) cannot import. Install it: {self.install}")
        return None

    def describe(self) -> str:
        """A few lines for `conform --list-presets`."""
        lines = [f"{self.name}: {self.engine}; cases: {self.cases}" + (f"; without {', '.join(self.without)}"
                                                                       if self.without else "")
                 + (f"; declares {', '.join(self.declare)}" if self.declare else "")
                 + (f"; GGUF {self.gguf}" if self.gguf else "") + (f" ({self.note})" if self.note else "")
                 + (f"; read against {', '.join(self.worker)} (the worker judged directly)" if self.worker else ""),
                 f"    launch:  {self.launch}"]
        lines += [f"    {kind}:{' ' * (8 - len(kind))}{cmd}" for kind, cmd in (("context", self.context),
                                                                           ("tight", self.tight)) if cmd]
        return "\n".join(lines + [f"    install: {self.install}"])


def _read(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PresetError(f"{path}: not a readable presets file ({exc})") from None
    if data.get("format") != FORMAT:
        raise PresetError(f"{path}: format {data.get('format')!r}, expected {FORMAT}")
    if unknown := sorted(set(data) - {"format", "preset", "gguf"}):
        raise PresetError(f"{path}: unknown table(s) {', '.join(unknown)} (known: format, preset, gguf)")
    if not isinstance(data.get("preset", {}), dict):
        raise PresetError(f"{path}: [preset.NAME] tables expected")
    return data


def _fields(text: str) -> set[str]:
    return {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}


def _resolve(name: str, raw: Mapping[str, Mapping[str, Any]], where: Mapping[str, Path],
             seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The preset's fields with `extends` applied: the parent's (its aliases left out), then its own;
    {launch} in its own launch is the parent's."""
    entry = raw[name]
    if not isinstance(entry, dict):
        raise PresetError(f"{where[name]}: preset {name} is not a table")
    if unknown := sorted(set(entry) - set(FIELDS)):
        raise PresetError(f"{where[name]}: preset {name}: unknown field(s) {', '.join(unknown)} "
                          f"(known: {', '.join(FIELDS)})")
    for key, value in entry.items():
        if not isinstance(value, FIELDS[key][0]) or isinstance(value, bool) or (
                isinstance(value, list) and not all(isinstance(v, str) for v in value)):
            raise PresetError(f"{where[name]}: preset {name}: {key} must be a "
                              f"{'list of strings' if FIELDS[key][0] is list else FIELDS[key][0].__name__}, "
                              f"not {value!r}")
    parent = entry.get("extends", "")
    if not parent:
        return dict(entry)
    if parent not in raw:
        raise PresetError(f"{where[name]}: preset {name} extends {parent!r}, which is no preset")
    if parent in (*seen, name):
        raise PresetError(f"{where[name]}: preset {name} extends itself through {' -> '.join((*seen, name, parent))}")
    base = {k: v for k, v in _resolve(parent, raw, where, (*seen, name)).items() if k not in NOT_INHERITED}
    own = dict(entry)
    if "launch" in own:
        own["launch"] = own["launch"].replace("{launch}", base["launch"])
    return {**base, **own}


def _preset(name: str, fields: Mapping[str, Any], path: Path) -> Preset:
    if missing := [k for k, (_, default) in FIELDS.items() if default is None and k not in fields]:
        raise PresetError(f"{path}: preset {name} has no {', '.join(missing)}")
    f = {k: fields.get(k, default) for k, (_, default) in FIELDS.items() if k != "extends"}
    for kind in ("context", "tight"):
        f[kind] = f[kind].replace("{launch}", f["launch"])
    for key, allowed in TEMPLATE_FIELDS.items():
        if bad := sorted(_fields(f[key]) - allowed):
            raise PresetError(f"{path}: preset {name}: {key} uses {', '.join('{' + b + '}' for b in bad)}; it may "
                              f"use {', '.join('{' + a + '}' for a in sorted(allowed))}")
    if f["context"] and "context" not in _fields(f["context"]):
        raise PresetError(f"{path}: preset {name}: its context command never says {{context}}")
    if f["gguf"] and f["gguf"] not in GGUF_FILES:
        raise PresetError(f"{path}: preset {name}: gguf {f['gguf']!r}; one of {', '.join(GGUF_FILES)}")
    if bool(f["gguf"]) != ("gguf" in _fields(f["launch"])):
        raise PresetError(f"{path}: preset {name}: a launch command loads {{gguf}} exactly when the preset has gguf")
    if f["cases"] not in CASE_SETS:
        raise PresetError(f"{path}: preset {name}: cases {f['cases']!r}; one of {', '.join(CASE_SETS)}")
    if bad := sorted(set(f["without"]) - set(WITHOUT)):
        raise PresetError(f"{path}: preset {name}: without {', '.join(bad)}; known: {', '.join(WITHOUT)}")
    if bad := sorted(set(f["declare"]) - set(DECISIONS)):
        raise PresetError(f"{path}: preset {name}: declare {', '.join(bad)}: no such decision; known: "
                          f"{', '.join(DECISIONS)}")
    if f["jobs"] < 1:
        raise PresetError(f"{path}: preset {name}: jobs must be 1 or more, not {f['jobs']}")
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in f.items()}
    return Preset(name=name, **values)


def load_presets(extra: Iterable[Path] = ()) -> dict[str, Preset]:
    """The shipped presets and those of `extra` files (a name already known is replaced), resolved
    and checked; a PresetError names the file, the preset and what is wrong."""
    raw: dict[str, Any] = {}
    where: dict[str, Path] = {}
    for path in (PRESETS_FILE, *extra):
        for name, entry in _read(path).get("preset", {}).items():
            raw[name], where[name] = entry, path
    return {name: _preset(name, _resolve(name, raw, where), where[name]) for name in raw}


def converter() -> Converter:
    """The GGUF converter of the shipped presets ([gguf])."""
    return Converter(**_read(PRESETS_FILE)["gguf"])


def _names(presets: Mapping[str, Preset]) -> dict[str, str]:
    """Every name and alias, lower case -> the preset's name."""
    return {**{a.lower(): p.name for p in presets.values() for a in p.aliases}, **{n.lower(): n for n in presets}}


def suggest(presets: Mapping[str, Preset], word: str) -> str | None:
    """The preset a near miss means (`--engine vllm`, `--preset llama.cpp`): a name or alias, any
    case, or a close spelling of one; None when nothing is close."""
    names = _names(presets)
    key = word.strip().lower()
    if key in names:
        return names[key]
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.75)
    return names[close[0]] if close else None


def find(presets: Mapping[str, Preset], name: str) -> Preset:
    """The preset called `name`; a PresetError lists the presets (and the one meant, when close)."""
    if name in presets:
        return presets[name]
    near = suggest(presets, name)
    hint = f" (did you mean --preset {near}?)" if near else ""
    raise PresetError(f"no preset {name!r}{hint}; presets: {', '.join(presets)} (`decodespec conform --list-presets`)")


def engine_path(path: str | None = None) -> str:
    """PATH for a launched engine: the caller's, then the folder of the Python running decodespec
    (so `decodespec serve` is found when that environment is not activated)."""
    here = str(Path(sys.executable).parent)
    parts = (path if path is not None else os.environ.get("PATH", "")).split(os.pathsep)
    return os.pathsep.join([p for p in parts if p] + ([here] if here not in parts else []))


# ---- the checkpoints a preset run serves ---------------------------------------------------------


def cache_root() -> Path:
    """Where built checkpoints and launch logs are kept: $DECODESPEC_CACHE, else
    $XDG_CACHE_HOME/decodespec, else ~/.cache/decodespec."""
    if os.environ.get("DECODESPEC_CACHE"):
        return Path(os.environ["DECODESPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "decodespec"


class _Behaviour(ast.NodeTransformer):
    """A module's syntax tree without what does not change what it computes: docstrings and type
    annotations (an annotated name stays, its annotation a placeholder: attrs reads the name as a
    field). Comments and layout are not in the tree."""

    def _undocumented(self, node: ast.AST) -> ast.AST:
        body = getattr(node, "body", [])
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            del body[0]
        return self.generic_visit(node)

    visit_Module = visit_ClassDef = _undocumented

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        node.returns = None
        return self._undocumented(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.annotation = None
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        node.annotation = ast.Constant(None)
        return self.generic_visit(node)


def source_form(path: Path) -> bytes:
    """What of a stamp source decides the checkpoints: a Python module's syntax tree without its
    docstrings and annotations (`_Behaviour`, as ast.dump writes it), any other file's bytes."""
    if path.suffix != ".py":
        return path.read_bytes()
    return ast.dump(_Behaviour().visit(ast.parse(path.read_bytes(), filename=str(path)))).encode()


def set_stamp(sources: Sequence[Path] = STAMP_SOURCES) -> str:
    """16 hex digits of sha256 over everything that decides the checkpoints (STAMP_SOURCES: a folder
    is its JSON files), each file named by its path from the source's parent and taken as
    `source_form` gives it, so an edit of a comment, a docstring or a type annotation keeps the
    built sets."""
    h = hashlib.sha256()
    for src in sources:
        for p in sorted(src.rglob("*.json")) if src.is_dir() else [src]:
            h.update(p.relative_to(src.parent).as_posix().encode() + b"\0" + source_form(p) + b"\0")
    return h.hexdigest()[:16]


def groups_needed(cases: Sequence[Case], every: Sequence[Case]) -> list[str]:
    """The checkpoint groups a run of `cases` serves: those its script cases compile into, and for its
    black-box cases the first group (by name) that is not a chat group, as launch.run_launched picks
    from a whole set."""
    from .checkpoints import group_of, http_blocker

    def script(c: Case) -> bool:
        return c.kind is CaseKind.SCRIPT and http_blocker(c) is None

    out = {group_of(c) for c in cases if script(c)}
    if any(c.kind is CaseKind.BLACKBOX for c in cases):
        out.add(min(group_of(c) for c in every if script(c) and chat_of(c) is None))
    return sorted(out)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One writer at a time in a set of checkpoints (runs of several presets share it)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".decodespec.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_checkpoints(root: Path, groups: Sequence[str], every: Sequence[Case],
                       echo: Callable[[str], None]) -> list[Path]:
    """The folders of `groups` under `root`, each built (whole, from every case of the group) where
    missing; a group is built under a temporary name and renamed into place, so a folder that exists
    is complete."""
    from .checkpoints import build_checkpoints, group_of, http_blocker

    with _locked(root):
        for g in groups:
            if (root / g).is_dir():
                continue
            todo = [c for c in every if c.kind is CaseKind.SCRIPT and http_blocker(c) is None and group_of(c) == g]
            tmp = root / f".{g}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            echo(f"building the forced checkpoint {g} ({len(todo)} case(s)) into {root / g}")
            [built] = build_checkpoints(todo, tmp, chat=False)
            built.folder.rename(root / g)
            tmp.rmdir()
    return [root / g for g in groups]


def llama_cpp_dir(given: Path | None, conv: Converter) -> Path:
    """The llama.cpp checkout the converter runs from (`given`, else $SOURCE); a PresetError says
    how to get one."""
    where = given or (Path(os.environ[conv.source]) if os.environ.get(conv.source) else None)
    if where is None:
        raise PresetError(f"llama.cpp engines serve GGUF files, which llama.cpp's converter writes: set {conv.source} "
                          f"to a llama.cpp checkout (or pass --llama-cpp DIR); to get one: {conv.install}")
    if not (where / "convert_hf_to_gguf.py").is_file():
        raise PresetError(f"{where} has no convert_hf_to_gguf.py: {conv.source} (or --llama-cpp) names a llama.cpp "
                          "checkout")
    return where


def convert_gguf(folders: Sequence[Path], preset: Preset, source: Path | None,
                 echo: Callable[[str], None]) -> list[Path]:
    """Write the preset's GGUF file beside each checkpoint's files where missing (llama.cpp's converter,
    its log kept as convert-<outtype>.log); the folders whose file exists come back. A checkpoint the
    converter refuses is left out (its cases are n/a, with the refusal: launch._refusal)."""
    name = preset.gguf_file
    if name is None or all((f / name).is_file() for f in folders):
        return list(folders)
    conv = converter()
    env = {**os.environ, conv.source: str(llama_cpp_dir(source, conv).resolve()), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    out = []
    for folder in folders:
        target = folder / name
        with _locked(folder.parent):
            if not target.is_file():
                echo(f"converting {folder} to {name} (llama.cpp's converter, --outtype {preset.gguf})")
                partial = folder / f"{name}.partial"
                log = folder / f"convert-{preset.gguf}.log"
                with open(log, "wb") as out_log:
                    done = subprocess.run(conv.argv(folder, partial, preset.gguf), env=env, stdout=out_log,
                                          stderr=subprocess.STDOUT)
                if done.returncode == 0 and partial.is_file():
                    partial.rename(target)
                else:
                    partial.unlink(missing_ok=True)
                    echo(f"llama.cpp's converter refused {folder} (see {log}); its cases are not run")
        if target.is_file():
            out.append(folder)
    return out
