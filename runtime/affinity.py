"""The engine thread's OpenMP team, one CPU each (§4.3; DECISIONS D62).

A decode step is a few dozen kernels, each split across the team and ended at a barrier: a kernel
takes as long as its slowest thread. With the team's threads free to move, the scheduler now and
then puts two of them on one core (the HTTP loop or a client took the other), and every kernel
then waits a time slice for the thread that is not running. `pin_team` gives the calling thread
and each of its workers a CPU of its own; the server's other threads still run anywhere.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

_TASKS = Path("/proc/self/task")


def pin_team(threads: int) -> tuple[int, ...]:
    """Pin the calling thread and the OpenMP workers of its kernels to the first `threads` CPUs this
    process may use, one each; returns those CPUs, or () when nothing was pinned: one thread, fewer
    CPUs than threads, no /proc to find the workers in, or a team that was not exactly `threads - 1`
    new threads (another thread started meanwhile: nothing is pinned on a guess).

    Call it on the thread that runs the kernels, after `torch.set_num_threads(threads)` and before
    its first kernel: the workers are the threads its first parallel region creates."""
    if threads < 2 or not hasattr(os, "sched_setaffinity") or not _TASKS.is_dir():
        return ()
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    if len(cpus) < threads:
        return ()
    before = {p.name for p in _TASKS.iterdir()}
    torch.ones(1 << 20).sum()  # large enough to be split: the team is made now
    workers = sorted(int(name) for name in {p.name for p in _TASKS.iterdir()} - before)
    if len(workers) != threads - 1:
        return ()
    for cpu, tid in zip(cpus, [threading.get_native_id(), *workers]):
        os.sched_setaffinity(tid, {cpu})
    return tuple(cpus)
