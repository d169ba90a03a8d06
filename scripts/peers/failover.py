"""The worker-failure gateway case (properties/conformance/life/failover.py) against a router's stack.

    .venv/bin/python scripts/peers/failover.py PRESET CHECKPOINT_SET REPORT_DIR [kill|stop]
        PRESET: a preset of scripts/peers/presets.toml whose stack writes its PIDs where STACK_PIDS
        says (routers.sh: vllm-router, smg; litellm.sh serve --workers 2: litellm-vllm-pair)

Starts the preset's stack on the set's byte_level_bpe checkpoint (with STACK_PIDS, so that it stays
up when a worker dies and names its workers' PIDs), runs the case with the first worker made to fail once each
stream has read the case's deltas (kill: SIGKILL to it and to every process under it, the default;
stop: SIGSTOP to them, a worker that hangs, resumed before the stack is stopped), stops the stack by
PID, and writes REPORT_DIR/failover.json (failover-stop.json) with the case's result in report.json's
form, and prints the result.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from decodespec.properties.conformance.adapters.openai import OpenAIAdapter
from decodespec.properties.conformance.checkpoints import Checkpoint
from decodespec.properties.conformance.launch import launched
from decodespec.properties.conformance.life import failover
from decodespec.properties.conformance.presets import find, load_presets
from decodespec.properties.conformance.reports import to_json
from decodespec.properties.conformance.runner import run_case

PRESETS = Path(__file__).resolve().parent / "presets.toml"
GROUP = "byte_level_bpe"


def _tree(pid: int) -> list[int]:
    """`pid` and every process under it (read from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        out.insert(0, p)
        todo += children.get(p, [])
    return out


SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
STACKS = ("routers.sh serve", "litellm.sh serve --workers 2")  # they write STACK_PIDS: two workers, then the gateway


def main(preset_name: str, ckpt_set: str, report_dir: str, how: str = "kill") -> None:
    preset = find(load_presets([PRESETS]), preset_name)
    if not any(stack in preset.launch for stack in STACKS):
        sys.exit(f"{preset_name}: its launch is none of {', '.join(STACKS)} (nothing here can kill one of its "
                 "workers)")
    ck = Checkpoint.load(Path(ckpt_set) / GROUP)
    out = Path(report_dir)
    log = Path(".cache/peers/logs") / out.name / "failover.log"
    with tempfile.TemporaryDirectory() as tmp:
        pids = Path(tmp) / "pids"
        env = {**os.environ, "STACK_PIDS": str(pids)}
        t0 = time.monotonic()
        with launched(preset.launch, ck, log, env=env) as url:
            worker, other, router = map(int, pids.read_text().split())

            gone = _tree(worker)

            def stop_one() -> str:
                for p in gone:
                    os.kill(p, SIGNALS[how])
                return (f"worker PID {worker} {'killed' if how == 'kill' else 'stopped'} "
                        f"({SIGNALS[how].name} to {len(gone)} processes; PID {other} kept serving)")

            name = preset.model.format(model=ck.folder, name=ck.group) if preset.model else None
            try:
                with failover.stopping(stop_one):
                    res = run_case(OpenAIAdapter(url, model=name, checkpoint=ck, launch=preset.launch), failover.CASE)
            finally:
                if how == "stop":  # a stopped process ignores SIGTERM until it runs again
                    for p in gone:
                        os.kill(p, signal.SIGCONT)
        wall = time.monotonic() - t0
    out.mkdir(parents=True, exist_ok=True)
    report = to_json([res], f"{preset_name} (worker failure: {how})", wall)
    (out / ("failover.json" if how == "kill" else f"failover-{how}.json")).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{failover.CASE.id} through {preset_name}, a worker {'killed' if how == 'kill' else 'stopped'}: {res.verdict.value} ({wall:.0f} s wall, start-up included)")
    for note in res.observed.get("notes", []):
        print(" ", note)
    for f in res.failures:
        print(f"  {f.symptom}: {f.message}")
    if res.reason:
        print(" ", res.reason)


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5) or sys.argv[4:] not in ([], ["kill"], ["stop"]):
        sys.exit(__doc__)
    main(*sys.argv[1:])
