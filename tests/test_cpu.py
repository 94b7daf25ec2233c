"""CPU threads for a run on a busy machine (issue 14, item 5): the cores idle at start, at least one.

The timing itself is measured by `tools/loaded_demo.py` (figures in the README), not by a test.
"""

from __future__ import annotations


import pytest
import torch

from minitrain import cpu


@pytest.mark.parametrize("cores,idle,want", [(2, 0.0, 1), (2, 0.4, 1), (2, 0.6, 1), (2, 1.6, 2), (2, 2.0, 2),
                                             (16, 9.7, 10), (4, 7.0, 4)])
def test_threads_are_the_idle_cores_at_least_one(cores, idle, want):
    assert cpu.choose_threads(cores, idle) == want


def test_idle_cores_from_two_proc_stat_samples(monkeypatch):
    samples = iter([(1000, 4000), (1150, 4200)])  # 150 of 200 jiffies idle over the sample
    monkeypatch.setattr(cpu, "_cpu_times", lambda: next(samples))
    assert cpu.idle_cores(2, sample_s=0) == pytest.approx(1.5)


def test_idle_cores_fall_back_to_the_load_average(monkeypatch):
    monkeypatch.setattr(cpu, "_cpu_times", lambda: None)
    monkeypatch.setattr(cpu.os, "getloadavg", lambda: (1.5, 0.0, 0.0))
    assert cpu.idle_cores(2) == pytest.approx(0.5)


def test_set_threads_takes_the_key_then_omp_num_threads_then_the_idle_cores(monkeypatch):
    before = torch.get_num_threads()
    said: list[str] = []
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert cpu.set_threads(1, said.append) == 1 and torch.get_num_threads() == 1
        assert said[-1].startswith("cpu threads: 1 (threads=;")
        monkeypatch.setattr(cpu, "idle_cores", lambda cores: 0.2)  # every core busy
        assert cpu.set_threads(0, said.append) == 1 and "0.2 of" in said[-1]
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert cpu.set_threads(0, said.append) == 2 and "(OMP_NUM_THREADS;" in said[-1]
    finally:
        torch.set_num_threads(before)
