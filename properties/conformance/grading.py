"""Verdicts and the grading profiles (D69): the weights a finding may have and the verdict each
weight gives its case under a profile (runner.grade applies them). Data only, so the command line
offers the profiles without loading an adapter (and through it torch)."""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Verdict(enum.StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    DIFFERS = "DIFFERS"
    SKIP = "SKIP"
    ERROR = "ERROR"


# What a finding weighs: by its severity, then (for text, ending and accounting) by its basis.
CHAPTER_W, DECISION_W, SHAPE_W, WIRE_W, DECLARED_W = "chapter", "decision", "shape", "wire", "declared"
# A finding resting only on fields the engine ignored in every case that could show it (D71): the
# run states that cause once, so like a declared choice it weighs nothing in its case.
ENGINE_WIDE_W = "engine_wide"
# The verdict each weight gives its case under a profile (a weight it does not list leaves PASS):
# `project` (the default) judges the chapter and this project's decisions, `chapter` the chapter alone.
PROFILES: Mapping[str, Mapping[str, Verdict]] = {
    "project": {CHAPTER_W: Verdict.FAIL, DECISION_W: Verdict.DIFFERS},
    "chapter": {CHAPTER_W: Verdict.FAIL},
}
DEFAULT_PROFILE = "project"
