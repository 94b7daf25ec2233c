"""tools/bench.py's plumbing on a tiny shape: setup, one run per side, parsing, the report. No timing asserts.

What is checked: the cached checkpoint and data are made once and both tokenizers (minitrain's and
transformers') give the same ids; a minitrain run and an HF run each go through a fresh
subprocess and the parent reads their step lines, peak RSS and exit code; the figures are
summarised and written between the markers of BENCHMARKS.md without touching the text around
them; `--gpu-dpo-7b` skips with a clear message without CUDA and its logic runs on a tiny
Mistral on the CPU.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("minitrain_tools_bench", ROOT / "tools" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = ["--steps", "2", "--batch", "2", "--accum", "1", "--dpo-steps", "2", "--dpo-batch", "1", "--dpo-accum", "1",
        "--layers", "1", "--dim", "32", "--ffn", "64", "--heads", "2", "--kv-heads", "2", "--vocab", "300",
        "--max-len", "64", "--repeats", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    a = bench.parse([*TINY, "--cache", str(tmp_path_factory.mktemp("bench"))])
    return a, bench.prepare(a)


def test_prepare_is_cached_and_tokenizers_agree(tiny):
    a, info = tiny
    assert bench.prepare(a) == info  # second call: from the cache
    rows = [json.loads(x) for x in open(info["sft"])]
    assert len(rows) == a.steps * a.batch * a.accum
    assert len(open(info["dpo"]).readlines()) == a.dpo_steps * a.dpo_batch * a.dpo_accum
    from transformers import AutoTokenizer

    from minitrain.text.tokenizer import Tokenizer

    ours, theirs = Tokenizer.from_folder(info["model"]), AutoTokenizer.from_pretrained(info["model"])
    assert ours.vocab_size == len(theirs) == a.vocab
    for r in rows:
        text = r["prompt"] + " " + r["completion"]
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
        # ids compose: prompt + completion == prompt ids + completion ids (same sequences on both sides)
        assert ours.encode(text) == ours.encode(r["prompt"]) + ours.encode(r["completion"], continuation=True)


def timed(s: dict, key: str = "tokens_per_s") -> bool:
    """A positive rate, or NaN because the tiny run's step lines all arrived in one 5 ms poll."""
    return s[key] > 0 or (math.isnan(s[key]) and s["times"][-1] == s["times"][0])


def test_minitrain_run_is_timed_from_its_metrics(tiny):
    a, info = tiny
    s = bench.run_one("sft", "mt", a, info, rep=0)
    assert s["rc"] == 0 and s["steps"] == a.steps
    assert 0 < s["first_step_s"] and s["peak_rss_mb"] > 50 and timed(s)
    assert s["command"][1:4] == ["-m", "minitrain", "recipes/sft_llama.py"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_hf_worker_runs_and_counts_tokens_like_minitrain(tiny, kind):
    pytest.importorskip("trl")
    a, info = tiny
    hf = bench.run_one(kind, "hf", a, info, rep=0)
    assert hf["rc"] == 0 and hf["steps"] == (a.steps if kind == "sft" else a.dpo_steps)
    assert timed(hf) and hf["first_step_s"] > 0
    if kind == "dpo":
        assert timed(hf, "pairs_per_s")
    else:  # the same rows, the same tokens: the non-pad count of the whole run matches minitrain's
        mt = bench.run_one(kind, "mt", a, info, rep=1)
        assert mt["tokens_total"] == hf["tokens_total"]


@pytest.mark.slow
@pytest.mark.parametrize("kind,unit", [("orpo", "pairs"), ("kto", "rows"), ("rm", "pairs")])
def test_orpo_and_kto_run_on_both_sides_on_the_same_rows(tiny, kind, unit):
    """ORPO: the DPO pairs through `loss_type=orpo` and TRL's ORPOTrainer; KTO: the pairs unpaired
    (2 rows each) through recipes/kto_mistral.py and TRL's KTOTrainer; both timed per pair / row."""
    pytest.importorskip("trl")
    a, info = tiny
    rows = [json.loads(x) for x in open(info["kto"])]
    pairs = [json.loads(x) for x in open(info["dpo"])]
    assert [r["completion"] for r in rows] == [p[k] for p in pairs for k in ("chosen", "rejected")]
    assert [r["label"] for r in rows] == [True, False] * len(pairs)
    for side in ("mt", "hf"):
        s = bench.run_one(kind, side, a, info, rep=0)
        assert s["rc"] == 0 and s["steps"] == a.dpo_steps, side
        assert timed(s, f"{unit}_per_s"), side
    cmd = bench.mt_command(kind, a, info, Path("o"))
    assert ("recipes/kto_mistral.py" in cmd) == (kind == "kto") and ("loss_type=orpo" in cmd) == (kind == "orpo")


def test_summary_of_steps_seen_in_one_poll_has_no_rate_but_counts_tokens():
    run = {"rc": 0, "times": [1.0, 1.0], "cpu": [2.5, 2.5], "rows": [{"tokens": 7}, {"tokens": 9}],
           "wall": 1.5, "peak_rss_mb": 400.0}
    s = bench.summarize("dpo", "mt", run, pairs_per_step=2)
    assert s["tokens_total"] == 16 and s["first_step_s"] == 1.0
    assert all(math.isnan(s[k]) for k in ("tokens_per_s", "tokens_per_cpu_s", "pairs_per_s", "pairs_per_cpu_s"))


def test_summary_table_and_benchmarks_markers(tmp_path, tiny):
    a, info = tiny
    run = {"rc": 0, "times": [2.0, 2.5, 3.0], "rows": [{"tokens": 10}, {"tokens": 20}, {"tokens": 30}],
           "wall": 3.5, "peak_rss_mb": 400.0}
    s = bench.summarize("dpo", "mt", run, pairs_per_step=2)
    assert s["first_step_s"] == 2.0 and s["tokens_per_s"] == 50.0 and s["pairs_per_s"] == 4.0
    h = dict(s, tokens_per_s=25.0, pairs_per_s=1.0, peak_rss_mb=800.0, first_step_s=8.0)
    results = {"dpo": {"mt": [s], "hf": [h]}}
    extra = {"machine": bench.machine(), "versions": {"torch": "x"}, "date": "today", "load_before": "1",
             "load_after": "1"}
    block = bench.render(a, results, info, ["--repeats", "1"], extra)
    assert "| pairs/s (steps 2..N) | 4 | 1 | **4.00x** | >= 2x |" in block
    assert "| time to first step (s) | 2 | 8 | **0.25x** |" in block
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(f"# Benchmarks\n\nintro\n\n{bench.BEGIN}\nold\n{bench.END}\n\nanalysis kept\n")
    bench.write_benchmarks(md, block)
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nintro") and text.endswith("analysis kept\n")
    assert "old" not in text and text.count(bench.BEGIN) == 1


def test_failed_run_is_reported_not_summarised():
    s = bench.summarize("sft", "hf", {"rc": 1, "times": [], "rows": [], "wall": 1.0, "peak_rss_mb": 1.0}, 1)
    assert s["rc"] == 1 and "tokens_per_s" not in s


def test_gpu_dpo_7b_skips_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the real measurement runs instead")
    assert bench.main(["--gpu-dpo-7b"]) == 0
    assert capsys.readouterr().out.startswith("skipped: --gpu-dpo-7b needs a CUDA device")


def test_gpu_dpo_7b_logic_on_a_tiny_mistral_on_cpu(tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "r.json"
    assert bench.main(["--gpu-dpo-7b", "--tiny", "--device", "cpu", "--seq", "64", "--dpo-steps", "2",
                       "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["steps"] == 2 and r["shape"] == "tiny" and r["predicted_peak_bytes"] > r["predicted_persistent_bytes"]
    assert r["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]  # recipes/dpo_mistral.py's default


def test_cli_parses_defaults():
    a = bench.parse([])
    assert (a.layers, a.dim, a.vocab, a.repeats) == (4, 256, 32000, 3)
    assert a.targets == bench.ALL_LINEAR and a.threads == 1 and a.sides == ["mt", "hf"]
    assert "group_by_length=false" in bench.mt_command("sft", a, {"model": "m", "sft": "s", "dpo": "d"}, Path("o"))


@pytest.mark.slow
def test_moe_shape_trains_the_experts_on_both_sides(tmp_path_factory):
    """`--experts`: a Qwen3-MoE checkpoint saved by transformers; minitrain's expert targets and peft's
    `target_parameters` (the experts' 3-D weights) on the HF side; both runs process the same tokens."""
    pytest.importorskip("peft")
    a = bench.parse([*TINY, "--experts", "4", "--expert-ffn", "32", "--cache", str(tmp_path_factory.mktemp("moe"))])
    info = bench.prepare(a)
    config = json.loads((Path(info["model"]) / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2
    spec = bench.hf_spec("sft", a, info, Path("o"))
    assert spec["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert spec["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert "lora_targets=q_proj,k_proj,v_proj,o_proj,experts.gate_up_proj,experts.down_proj" in \
        bench.mt_command("sft", a, info, Path("o"))
    mt, hf = (bench.run_one("sft", side, a, info, rep=0) for side in ("mt", "hf"))
    assert mt["rc"] == hf["rc"] == 0 and mt["tokens_total"] == hf["tokens_total"]
