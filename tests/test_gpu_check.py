"""tools/gpu_check.py: skips cleanly without CUDA; its BENCHMARKS.md section from (fake) results."""

from __future__ import annotations

import importlib.util
import re
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
    results = {"git": "abc1234", "torch": "2.13", "tests": {"rc": 0, "summary": "5 passed in 30s"},
               "dpo": {"seq": 1024, "max_allocated_bytes": 5.6e9, "max_reserved_bytes": 6.1e9, "steps": 3, "seconds": 40,
                       "predicted_peak_bytes": 5.52e9, "measured_over_predicted": 5.6 / 5.52},
               "sft": {"plan": {"tokens_per_s": 9000.0, "mfu": 0.41, "peak_allocated_bytes": 30e9, "checkpointing": 12},
                       "ckpt": {"error": "exit 1: out of memory"},
                       "hf_peft": {"tokens_per_s": 6000.0, "mfu": 0.27, "peak_allocated_bytes": 40e9},
                       "hf_liger": {"error": "liger-kernel is not installed", "optional": True}},
               "grpo": {"batch": 64, "prompt": 128, "new_tokens": 256, "sampler_tokens_per_s": 3000.0,
                        "generate_tokens_per_s": 2000.0, "equal_rows": 60, "step_generation_s": 3.0,
                        "step_training_s": 1.0, "completions": 64, "step_peak_allocated_bytes": 8e9}}
    section = gpu_check.render(results, "2026-11-24 20:00 UTC", "NVIDIA H100 80GB HBM3")
    assert "### GPU check, 2026-11-24 20:00 UTC on NVIDIA H100" in section
    assert "5.60 GB max allocated" in section and "target <= 8 GB: met" in section
    assert "| minitrain, checkpointing as the plan fits it to 24 GB (checkpointing=12) | 9000 | 41.0% | 30.00 GB | 1.50x | 0.75x |" in section
    assert "exit 1: out of memory" in section and "liger-kernel is not installed" in section
    assert "3000 tokens/s, transformers `generate` 2000 (1.50x); rows with equal tokens 60/64" in section
    assert ("generation 3.00 s (5461 tokens/s with the adapters, sampling at temperature 1), training (forward, loss, "
            "backward) 1.00 s (75% generating)") in section
    assert gpu_check.failures(results) == ["sft ckpt"]  # the optional side that is not installed is no failure
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\nkeep me\n")
    gpu_check.write_section(md, section)
    gpu_check.write_section(md, section.replace("| 9000 |", "| 9100 |"))
    text = md.read_text()
    assert text.count(gpu_check.BEGIN) == 1 and "keep me" in text and "| 9100 |" in text and "| 9000 |" not in text


def test_tiny_check_runs_its_parts_on_the_cpu(tmp_path):
    """`--tiny` runs each part's code on tiny shapes (on the CPU here), so that the script works when a GPU
    comes: every side of every comparison returns its figures, the section is written. The sft part's
    variants are the packed part's runs with other keys: their keys are checked, their runs left out."""
    from minitrain.config import TrainConfig

    for _, keys in gpu_check.SFT_VARIANTS.values():
        TrainConfig(**keys)  # each variant's keys are TrainConfig's
    target = tmp_path / "B.md"
    gpu_check.write_section(target, "### GPU check, the first call of a split run")  # --append keeps it
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--tiny", "--write", str(target),
                        "--parts", "dpo,packed,qlora,grpo,moe", "--append"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = target.read_text()
    assert text.count(gpu_check.BEGIN) == 1 and text.count("### GPU check, ") == 2
    assert text.index("the first call of a split run") < text.index("on CPU (--tiny")
    assert "on CPU (--tiny: the figures mean nothing)" in text
    for label in [v[0] for k, v in gpu_check.PACKED_VARIANTS.items() if k != "packed"]:  # flex: no backward on a CPU
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| {label}"))
        assert re.match(r"\| [^|]+ \| \d+ \|", row), row  # a tokens/s figure, not an error
    for label in ("transformers + peft, padded batch", "transformers + bitsandbytes nf4 + peft",
                  "minitrain, nf4", "minitrain, grouped experts", "transformers grouped_mm experts + peft"):
        assert re.search(r"\| " + re.escape(label) + r"( \([^|]*\))? \| \d+ \|", text), label
    assert "FlexAttention trains only on CUDA" in text
    assert "rows with equal tokens 8/8" in text  # greedy: the sampler and generate agree on every row
    assert "QLoRA DPO, tiny shape, seq 64, eager: 3 steps in" in text
