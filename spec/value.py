"""One spec as a value: every machine's table, loaded and validated together (§4.1-§4.8).

What runs (generate, the Engine, the server, the monitors, the checker) takes a `Spec`, so the
shipped tables and an edited copy run side by side in one process. A caller that passes none gets
`default_spec()`: the spec directory's tables (spec/, or the copy DECODESPEC_SPEC_DIR names, a
command line convenience), loaded once, on first use.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

import attrs

from .loader import MACHINES, SpecError, load_file, load_spec
from .tables import Table
from .vocabulary import SPEC_DIR


@attrs.frozen(eq=False)
class Spec:
    """The tables of every machine of MACHINES, by name; `source` says where they came from."""

    tables: Mapping[str, Table] = attrs.field(converter=lambda t: dict(t))
    source: str = "<tables>"

    def __attrs_post_init__(self) -> None:
        missing = [n for n in MACHINES if n not in self.tables]
        unknown = [n for n in self.tables if n not in MACHINES]
        misnamed = [n for n, t in self.tables.items() if n in MACHINES and t.name != n]
        if missing or unknown or misnamed:
            raise SpecError(self.source, "tables", f"a spec holds one table of each of {', '.join(MACHINES)}; "
                                                   f"missing {missing}, unknown {unknown}, misnamed {misnamed}")

    def __getitem__(self, name: str) -> Table:
        table = self.tables.get(name)
        if table is None:
            raise SpecError(self.source, "name", f"no such machine {name!r}; known: {', '.join(MACHINES)}")
        return table

    def replace(self, *tables: Table) -> Spec:
        """This spec with each of `tables` in place of the table of its name."""
        return Spec({**self.tables, **{t.name: t for t in tables}}, f"{self.source} (edited)")

    @classmethod
    def load(cls, directory: str | Path) -> Spec:
        """The tables of a spec directory (a copy of spec/), each validated; a broken one raises SpecError."""
        d = Path(directory)
        return cls({name: load_file(d / f"{name}.toml") for name in MACHINES}, str(d))


@functools.cache
def default_spec() -> Spec:
    """The spec directory's tables (the ones `load_spec` gives), built on first use."""
    return Spec({name: load_spec(name) for name in MACHINES}, str(SPEC_DIR))
