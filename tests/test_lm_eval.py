"""minitrain evaluate (lm-evaluation-harness 0.4, `--model minitrain`) against lm-eval's own `hf` backend.

A tiny LLaMA saved by transformers (max_position_embeddings=64, so contexts are truncated and texts
span several rolling windows) and a PEFT adapter saved by peft (random B, so it changes the
outputs). Three local task files, one per request type lm-eval has (multiple choice ->
`loglikelihood`, perplexity -> `loglikelihood_rolling`, `generate_until`), run through ours and
through `hf` (transformers + peft, the same checkpoint and adapter): per-example log-likelihoods
equal to 1e-4 and greedy generations identical.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from _tok import corpus, make_bpe_tokenizer

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[1]
TASKS = ("mt_choice", "mt_ppl", "mt_gen")


def task_yaml(name: str, data: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


def peft_adapter(model: Path, out: Path, seed: int, **targets) -> None:
    """A peft LoRA (r=4) on transformers' `model` with random B (so it changes the outputs), saved to `out`."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, **targets))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    pm.save_pretrained(out)


@pytest.fixture(scope="module")
def setup(hf_causal, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm_eval")
    model = root / "model"
    shutil.copytree(hf_causal("lm_eval_llama", max_position_embeddings=64), model)
    make_bpe_tokenizer(model)
    peft_adapter(model, root / "adapter", 1, target_modules=["q_proj", "v_proj", "down_proj"])
    lines = corpus(40, seed=9)
    rows = {
        "choice": [{"question": lines[i], "choices": [" " + lines[i + 1], " " + lines[i + 2], lines[i + 3]],
                    "answer": i % 3} for i in range(0, 24, 4)],
        "text": [{"text": " ".join(lines[i:i + 6])} for i in range(0, 30, 6)],
        "gen": [{"question": lines[i], "answer": lines[i + 1]} for i in range(6)],
    }
    for name, rs in rows.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "choice.yaml").write_text(task_yaml("mt_choice", root / "choice.jsonl", (
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n')))
    (tasks / "ppl.yaml").write_text(task_yaml("mt_ppl", root / "text.jsonl", (
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        'metric_list:\n  - metric: word_perplexity\n')))
    (tasks / "gen.yaml").write_text(task_yaml("mt_gen", root / "gen.jsonl", (
        'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["zz"]\n  max_gen_toks: 12\n  do_sample: false\n'
        'metric_list:\n  - metric: exact_match\n')))
    (tasks / "hub.yaml").write_text('task: mt_hub\ndataset_path: someone/some_dataset\ntest_split: test\n'
                                    'output_type: loglikelihood\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\n')
    return {"root": root, "model": model, "adapter": root / "adapter", "tasks": tasks}


def per_example(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_loglikelihoods_and_generations_equal_lm_evals_hf_backend(setup, tool):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    ours = tool.evaluate(f"pretrained={setup['model']},adapter={setup['adapter']}", list(TASKS),
                         include_path=str(setup["tasks"]), log_samples=True, batch_size=4)
    ref = simple_evaluate(model="hf", model_args=f"pretrained={setup['model']},peft={setup['adapter']},dtype=float32",
                          tasks=list(TASKS), task_manager=TaskManager(include_path=str(setup["tasks"]), include_defaults=False),
                          log_samples=True, batch_size=4, device="cpu")
    for task in ("mt_choice", "mt_ppl"):
        a, b = per_example(ours, task), per_example(ref, task)
        assert len(a) == len(b) > 0
        for ra, rb in zip(a, b):
            for x, y in zip(ra, rb):
                x, y = x[0], y[0]
                if isinstance(x, (list, tuple)):  # loglikelihood: (logp, is_greedy)
                    assert x[0] == pytest.approx(y[0], abs=1e-4) and x[1] == y[1]
                else:  # loglikelihood_rolling: the text's logp
                    assert x == pytest.approx(y, abs=1e-4)
    gens_a, gens_b = per_example(ours, "mt_gen"), per_example(ref, "mt_gen")
    assert gens_a == gens_b and any(g[0][0] for g in gens_a)  # identical, and not all empty
    # by its registered name, as lm-eval's own entry points take a model
    tool.register()
    named = simple_evaluate(model="minitrain", model_args=f"pretrained={setup['model']},adapter={setup['adapter']}",
                            tasks=["mt_choice"], task_manager=TaskManager(include_path=str(setup["tasks"]),
                                                                          include_defaults=False),
                            log_samples=True, batch_size=4, device="cpu")
    assert per_example(named, "mt_choice") == per_example(ours, "mt_choice")
    # the adapter matters: without it the scores move
    base = tool.evaluate(f"pretrained={setup['model']}", ["mt_choice"], include_path=str(setup["tasks"]),
                         log_samples=True, batch_size=4)
    assert per_example(base, "mt_choice")[0][0][0][0] != pytest.approx(per_example(ours, "mt_choice")[0][0][0][0],
                                                                        abs=1e-3)



def test_moe_with_an_expert_adapter_equals_lm_evals_hf_backend(setup, tool, hf_causal, tmp_path):
    """A tiny Qwen3-MoE (max_position_embeddings=64) with a peft adapter on the attention and the experts
    (`target_parameters`): log-likelihoods, rolling log-likelihoods and greedy generations equal lm-eval's
    `hf` backend (transformers + peft) on the same tasks."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from test_moe import MOE_VARIANTS

    model = tmp_path / "model"
    shutil.copytree(hf_causal("lm_eval_qwen3_moe", **{**MOE_VARIANTS["qwen3_moe"], "max_position_embeddings": 64}),
                    model)
    make_bpe_tokenizer(model)
    peft_adapter(model, tmp_path / "adapter", 2, target_modules=["q_proj"],
                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    args = f"pretrained={model},adapter={tmp_path / 'adapter'}"
    ours = tool.evaluate(args, list(TASKS), include_path=str(setup["tasks"]), log_samples=True, batch_size=4)
    ref = simple_evaluate(model="hf", model_args=f"pretrained={model},peft={tmp_path / 'adapter'},dtype=float32",
                          tasks=list(TASKS), task_manager=TaskManager(include_path=str(setup["tasks"]), include_defaults=False),
                          log_samples=True, batch_size=4, device="cpu")
    for task in ("mt_choice", "mt_ppl"):
        a = [x[0] for r in per_example(ours, task) for x in r]
        b = [x[0] for r in per_example(ref, task) for x in r]
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            assert (x[0] if isinstance(x, (list, tuple)) else x) == pytest.approx(
                y[0] if isinstance(y, (list, tuple)) else y, abs=1e-4)
    assert per_example(ours, "mt_gen") == per_example(ref, "mt_gen")

@pytest.fixture(scope="module")
def tool():
    """minitrain evaluate under a name of its own (`evaluate` is also Hugging Face's package, which lm-eval imports)."""
    module = importlib.import_module("minitrain.commands.evaluate")
    return module


def one_line(capsys, tool, needle: str, *args) -> None:
    capsys.readouterr()
    code = tool.main([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_bad_inputs_are_one_line(setup, tool, tmp_path, capsys):
    from minitrain.cli import run_cli

    m, tasks = setup["model"], setup["tasks"]
    one_line(capsys, tool, "reads its data from the Hugging Face Hub",
             "--model_args", f"pretrained={m}", "--tasks", "mt_hub", "--include_path", tasks)
    one_line(capsys, tool, "no such adapter folder",
             "--model_args", f"pretrained={m},adapter={tmp_path / 'nope'}", "--tasks", "mt_choice",
             "--include_path", tasks)
    # an adapter whose run trained it on another base: the checkpoint's fingerprint says so
    other = tmp_path / "other"
    shutil.copytree(m, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg))
    run = tmp_path / "run"
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(4, seed=2)))
    assert run_cli([str(REPO / "recipes" / "sft_llama.py"), f"model={other}", f"data={train}", f"out={run}",
                    "max_steps=1", "batch_size=2", "lora_r=2", "device=cpu"]) == 0
    one_line(capsys, tool, "was trained on another base model",
             "--model_args", f"pretrained={m},adapter={run / 'adapter'}", "--tasks", "mt_choice",
             "--include_path", tasks)
