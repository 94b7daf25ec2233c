"""Shared fixtures: tiny reference checkpoints saved by `transformers` (test extra only).

`hf_causal(name, **overrides)` saves a tiny causal checkpoint of any family transformers knows once per session and returns
its folder. Overrides are HF config fields (e.g. `num_key_value_heads=2`, `sliding_window=4`,
`model_type="mistral"`, `tie_word_embeddings=True`, `rope_scaling={...}`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

# The suite runs on every core this process may use, up to 4 (pytest-xdist, `-n auto` in pyproject.toml),
# one test file per worker at a time (`--dist loadfile`: a file's module fixtures are built once). The
# longest files start first, so that no worker is left with a long file at the end while the others idle.
MAX_WORKERS = 4
LONGEST_FIRST = ["test_torchrun_resume.py", "test_fsdp_load.py", "test_plan.py", "test_trackers.py",
                 "test_tools.py", "test_distributed.py", "test_train.py", "test_gpu_check.py", "test_moe.py",
                 "test_packaging.py", "test_bench.py", "test_shadow.py"]


def pytest_xdist_auto_num_workers(config) -> int:
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order

# token stores (data_cache=auto) of the runs the tests make go to a folder of this session, not the user's cache
_CACHE = tempfile.mkdtemp(prefix="minitrain-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def save_hf_causal(folder: Path, seed: int = 0, model_type: str = "llama", **overrides) -> Path:
    """Save a tiny random HF causal LM with transformers (fp32) into `folder`."""
    import transformers

    kw = {**TINY_LLAMA, **overrides}
    # any causal family transformers knows (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # random init has tiny norms and zero biases; perturb so every tensor matters
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


@pytest.fixture(scope="session")
def hf_causal(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(name: str, **overrides) -> Path:
        if name not in cache:
            cache[name] = save_hf_causal(tmp_path_factory.mktemp(name), **overrides)
        return cache[name]

    return make


@pytest.fixture(scope="session")
def tiny_model(hf_causal, tmp_path_factory) -> Path:
    """A tiny LLaMA with a BPE tokenizer (the torchrun / CLI tests' model)."""
    import shutil

    from _tok import make_bpe_tokenizer

    d = tmp_path_factory.mktemp("dist_model") / "model"
    shutil.copytree(hf_causal("dist_llama"), d)
    make_bpe_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def recipe_inputs(hf_causal, tmp_path_factory) -> dict[str, Path]:
    """Tiny inputs for every recipe (`tests/_recipes.py`: models, data, a reward; `args_for` builds
    each recipe's command line over them)."""
    from _recipes import make_recipe_inputs

    return make_recipe_inputs(tmp_path_factory.mktemp("recipe_inputs"), hf_causal)


RUN_JSON_FILES = ("metrics.jsonl", "eval.jsonl", "completions.jsonl")  # and predictions/step_*.jsonl


def non_strict_json(folder: Path) -> list[str]:
    """`file:line` of every line of a run's JSON files under `folder` that strict JSON refuses (NaN,
    Infinity: Python's json writes them by default, other readers do not take them)."""
    import json

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    bad = []
    for f in folder.rglob("*.jsonl"):
        if f.name in RUN_JSON_FILES or f.parent.name == "predictions":
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                try:
                    json.loads(line)
                except ValueError:  # not JSON at all: a file a test damaged on purpose, not a run's
                    continue
                try:
                    json.loads(line, parse_constant=refuse)
                except ValueError as e:
                    bad.append(f"{f}:{i}: {e}")
    return bad


@pytest.fixture(scope="session", autouse=True)
def every_runs_json_files_are_strict(tmp_path_factory):
    """After the session: every metrics / eval / completions / predictions file that any test's run
    wrote (all under pytest's temporary folders) holds strict JSON, NaN and infinities as null."""
    yield
    bad = non_strict_json(tmp_path_factory.getbasetemp())
    assert not bad, "run files that are not strict JSON:\n" + "\n".join(bad[:20])
