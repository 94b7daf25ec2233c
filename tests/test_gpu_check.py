"""tools/gpu_check.py: skips cleanly without CUDA; its BENCHMARKS.md section from (fake) results."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_skips_cleanly_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the real check runs instead")
    target = tmp_path / "B.md"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--write", str(target)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("skipped: no CUDA device here") and not p.stderr.strip()
    assert not target.exists()


def test_section_is_written_between_markers_and_replaced(tmp_path):
    results = {"git": "abc1234", "torch": "2.13", "tests": {"summary": "5 passed in 30s"},
               "dpo": {"seq": 1024, "max_allocated_bytes": 5.6e9, "max_reserved_bytes": 6.1e9,
                       "predicted_peak_bytes": 5.52e9, "measured_over_predicted": 5.6 / 5.52},
               "mt": {"tokens_per_s": 9000.0, "mfu": 0.41, "peak_allocated_bytes": 30e9},
               "hf": {"error": "exit 1: out of memory"}}
    section = gpu_check.render(results, "2026-11-24 20:00 UTC", "NVIDIA H100 80GB HBM3")
    assert "### GPU check, 2026-11-24 20:00 UTC on NVIDIA H100" in section
    assert "5.60 GB max allocated" in section and "target <= 8 GB: met" in section
    assert "| minitrain (per-block compile) | 9000 | 41.0% | 30.00 GB |" in section
    assert "exit 1: out of memory" in section
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\nkeep me\n")
    gpu_check.write_section(md, section)
    gpu_check.write_section(md, section.replace("9000", "9100"))
    text = md.read_text()
    assert text.count(gpu_check.BEGIN) == 1 and "keep me" in text and "| 9100 |" in text and "| 9000 |" not in text
