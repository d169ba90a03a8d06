"""A covering set of model paths for model-derived tests (§4.3 loop, §4.7-§4.9 faults).

The one-request model of machine/checker_model.py is explored breadth first. Each *target* is
either a table decision that some step fires, keyed ``("row"|"ignore", machine, state, event)``
(resources of every kind share the `resources` table), or a fault point, keyed ``("fault", label,
point)``: an environment injection (or the loop's observation of a cancel or deadline, or a content
policy interruption, D11) at a program point of §4.3. For each target the path returned is a shortest run from an initial state
through a step that hits the target to the end of the request (every path ends at "done").

`allow(comp, step)` restricts the steps a path may take (a driver that cannot reproduce some model
step excludes it); targets reachable in the model only through excluded steps are listed in
`PathSet.unreached`, so nothing is dropped silently. Depends on spec/ and machine/ only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from ..spec import Table
from .checker_model import Model, ModelConfig, Step, Tag
from .checker_state import PC_NAMES, RequestState

Target = tuple[str, ...]
DEFAULT_CONFIG = ModelConfig(policies=("pause", "buffer", "fail"))  # max_output_tokens 2, cap 1
Allow = Callable[[RequestState, Step], bool]

def machine_of(name: str) -> str:
    """`resources[kv_cache]` -> `resources`: the table a fired step belongs to."""
    return name.split("[", 1)[0]



@attrs.frozen
class PathStep:
    """One model step: its label, the loop point it starts from, the table steps it fires and its
    tag (what the step is, as data: checker_model.Tag; a fault point when `tag.fault`: an
    environment injection, the loop's observation of a cancel or deadline, a content policy
    interruption, D11)."""

    label: str
    point: str
    fired: tuple[tuple[str, str, str], ...]
    tag: Tag

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "point": self.point, "fired": [list(f) for f in self.fired],
                "tag": {k: v for k, v in attrs.asdict(self.tag).items() if v not in (None, False)}}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PathStep:
        return cls(obj["label"], obj["point"], tuple(tuple(f) for f in obj["fired"]), Tag(**obj["tag"]))


@attrs.frozen
class ModelPath:
    """A replayable run of the model, from an initial state to the request's end."""

    target: Target
    policy: str
    steps: tuple[PathStep, ...]

    def fired(self, machine: str) -> list[tuple[str, str]]:
        """(state, event) pairs of one machine, e.g. "lifecycle" or "resources[kv_cache]"."""
        return [(s, e) for st in self.steps for m, s, e in st.fired if m == machine]

    def machines(self) -> list[str]:
        return sorted({m for st in self.steps for m, _, _ in st.fired})

    def to_json(self) -> dict[str, Any]:
        return {"target": list(self.target), "policy": self.policy, "steps": [s.to_json() for s in self.steps]}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ModelPath:
        return cls(tuple(obj["target"]), obj["policy"], tuple(PathStep.from_json(s) for s in obj["steps"]))


@attrs.frozen
class PathSet:
    """Paths for every target the allowed steps reach; `unreached`: reachable only otherwise."""

    config: ModelConfig
    paths: Mapping[Target, ModelPath]
    reachable: frozenset[Target]
    unreached: frozenset[Target]
    states: int

    def distinct(self) -> list[ModelPath]:
        """The paths without repeats (one path often covers several targets)."""
        out: dict[tuple, ModelPath] = {}
        for p in self.paths.values():
            out.setdefault((p.policy, p.steps), p)
        return list(out.values())


def is_model_run(path: ModelPath, config: ModelConfig | None = None, tables: Mapping[str, Table] | None = None) -> bool:
    """True when `path` is still a complete run of the model (a kept regression path whose steps,
    points and table steps the current model takes, from its policy's initial state to the end)."""
    config = config or DEFAULT_CONFIG
    if path.policy not in config.policies:
        return False
    model = Model(tables, config)
    comps = {model.initial()[config.policies.index(path.policy)]}
    for ps in path.steps:
        comps = {
            s.post() for c in comps if PC_NAMES[c.pc] == ps.point
            for s in model.expand(c) if not s.dead and s.tag == ps.tag and s.label == ps.label and tuple(s.fired) == ps.fired
        }
        if not comps:
            return False
    return any(model.done(c) for c in comps)


class _Graph:
    """The explored one-request graph: edges (src, step, dst) with the targets each step hits."""

    def __init__(self, model: Model, allow: Allow | None) -> None:
        self.model = model
        self.init = model.initial()
        self.depth: dict[RequestState, int] = dict.fromkeys(self.init, 0)
        self.parent: dict[RequestState, tuple[RequestState, PathStep] | None] = dict.fromkeys(self.init)
        self.edges: list[tuple[RequestState, PathStep, RequestState, tuple[Target, ...]]] = []
        todo = deque(self.init)
        while todo:
            comp = todo.popleft()
            for step in model.expand(comp):
                if step.dead or (allow is not None and not allow(comp, step)):
                    continue
                post = step.post()
                ps = PathStep(step.label, PC_NAMES[comp.pc], tuple(step.fired), step.tag)
                self.edges.append((comp, ps, post, self._targets(ps)))
                if post not in self.depth:
                    self.depth[post] = self.depth[comp] + 1
                    self.parent[post] = (comp, ps)
                    todo.append(post)
        self._to_done()

    def _targets(self, ps: PathStep) -> tuple[Target, ...]:
        out: list[Target] = []
        for m, s, e in ps.fired:
            name = machine_of(m)
            out.append((self.model.tables[name].decision(s, e).kind.value, name, s, e))
        if ps.tag.fault:
            out.append(("fault", ps.label, ps.point))
        return tuple(out)

    def _to_done(self) -> None:
        """Backward BFS from the end states: distance to done and the first step on the way."""
        back: dict[RequestState, list[tuple[RequestState, PathStep]]] = {}
        for src, ps, dst, _ in self.edges:
            back.setdefault(dst, []).append((src, ps))
        self.dist = {c: 0 for c in self.depth if self.model.done(c)}
        self.next: dict[RequestState, tuple[PathStep, RequestState]] = {}
        todo = deque(self.dist)
        while todo:
            c = todo.popleft()
            for src, ps in back.get(c, ()):
                if src not in self.dist:
                    self.dist[src] = self.dist[c] + 1
                    self.next[src] = (ps, c)
                    todo.append(src)

    def path(self, src: RequestState, ps: PathStep, dst: RequestState) -> tuple[RequestState, tuple[PathStep, ...]]:
        head: list[PathStep] = []
        c = src
        while (link := self.parent[c]) is not None:
            c, step = link
            head.append(step)
        head.reverse()
        tail = [ps]
        c = dst
        while c in self.next:
            step, c = self.next[c]
            tail.append(step)
        return c, tuple(head + tail)

    def targets(self) -> set[Target]:
        return {t for *_, ts in self.edges for t in ts}


def covering_paths(
    config: ModelConfig | None = None,
    tables: Mapping[str, Table] | None = None,
    *,
    allow: Allow | None = None,
    targets: Iterable[Target] | None = None,
) -> PathSet:
    """One shortest complete path per target (all targets the model reaches, or `targets`).

    Default config (DEFAULT_CONFIG): max_output_tokens 2, all three backpressure policies, buffer cap 1.
    """
    config = config or DEFAULT_CONFIG
    model = Model(tables, config)
    full = _Graph(model, None)
    reachable = frozenset(full.targets())
    graph = full if allow is None else _Graph(model, allow)
    wanted = set(reachable if targets is None else targets)
    best: dict[Target, tuple[int, RequestState, PathStep, RequestState]] = {}
    for src, ps, dst, ts in graph.edges:
        if dst not in graph.dist:
            continue
        cost = graph.depth[src] + 1 + graph.dist[dst]
        for t in ts:
            if t in wanted and (t not in best or cost < best[t][0]):
                best[t] = (cost, src, ps, dst)
    paths = {}
    policies = config.policies
    for t, (_, src, ps, dst) in sorted(best.items()):
        end, steps = graph.path(src, ps, dst)
        start = src
        while (link := graph.parent[start]) is not None:
            start = link[0]
        assert model.done(end), f"path for {t} does not end"
        paths[t] = ModelPath(t, policies[start.policy], steps)
    return PathSet(
        config=config, paths=paths, reachable=reachable,
        unreached=frozenset(wanted - set(paths)), states=len(full.depth),
    )
