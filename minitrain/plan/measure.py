"""Measured peaks on the CPU, to check the plan against (tests/test_plan.py, tools/compiled_peak.py)."""

from __future__ import annotations

from typing import Any, Callable


def measure_peak_allocated(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(peak bytes allocated above the start while `fn()` runs, its result), on the CPU.

    Uses `torch.profiler`'s memory events (every CPU allocator allocation and free, in order):
    the running sum of their sizes is the bytes allocated since the start, and its maximum is
    the peak, like `torch.cuda.max_memory_allocated` minus what was allocated before. Frees of
    blocks allocated before the start are not reported by the profiler, so the figure never
    counts down below memory it did not see allocated.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == "CPU")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, result
