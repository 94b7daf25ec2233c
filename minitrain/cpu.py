"""How many CPU threads torch uses for a run on the CPU: the cores that are idle when it starts.

torch starts one intra-op thread per core. On a machine whose cores are busy with other jobs
those threads oversubscribe them: every parallel region waits for its slowest thread, which the
OS has parked behind another process, and the demo took 188 s at load ~5 on 2 cores against 16 s
with one thread. So a CPU run samples how busy the machine is (`/proc/stat` over 0.1 s, else
the 1-minute load average) and uses the idle cores, at least one. `threads=N` or the
`OMP_NUM_THREADS` environment variable choose it instead.
"""

from __future__ import annotations

import os
import time
from typing import Callable


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all cores since boot, from /proc/stat (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])


def idle_cores(cores: int, sample_s: float = 0.1) -> float:
    """How many of `cores` are idle right now: /proc/stat sampled over `sample_s`, else cores
    minus the 1-minute load average."""
    a = _cpu_times()
    if a is not None:
        time.sleep(sample_s)
        b = _cpu_times()
        if b is not None and b[1] > a[1]:
            return cores * (b[0] - a[0]) / (b[1] - a[1])
    try:
        return max(0.0, cores - os.getloadavg()[0])
    except OSError:
        return float(cores)


def choose_threads(cores: int, idle: float) -> int:
    """The idle cores, rounded, at least 1 and at most `cores`."""
    return max(1, min(cores, int(idle + 0.5)))


def set_threads(requested: int, log: Callable[[str], None]) -> int:
    """Set torch's intra-op threads for a CPU run and say so; returns the number.

    `requested` > 0 (the `threads` key) wins, then OMP_NUM_THREADS (left to torch), then the idle cores.
    """
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested > 0:
        n, why = requested, "threads="
    elif os.environ.get("OMP_NUM_THREADS"):
        n, why = torch.get_num_threads(), "OMP_NUM_THREADS"
    else:
        idle = idle_cores(cores)
        n, why = choose_threads(cores, idle), f"{idle:.1f} of {cores} cores idle"
    torch.set_num_threads(n)
    log(f"cpu threads: {n} ({why}; threads=N or OMP_NUM_THREADS to choose)")
    return n
