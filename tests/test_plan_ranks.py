"""The per-rank memory plan (`minitrain.plan.sharded`) of Qwen3.5 and Gemma 4, dense and MoE.

- the tensors FSDP2 shards, against the model built from config.json: each block's parameters (Qwen3.5's DeltaNet
  layers: in_proj_qkv / z / b / a, conv1d, dt_bias, A_log, the gated norm, out_proj; its gated attention's q_proj
  of 2 x the heads, q / k norms; Gemma 4's kv-shared layers without k / v or k norm, the per-layer input's gate,
  projection and norm; the MoE sizes' experts, routers, shared expert) and the root's (Gemma 4's per-layer
  embeddings, their projection and its norm), each rank's ceil(dim 0 / N) rows, to the byte;
- 2 gloo ranks (`test_plan_moe.ranks_worker`, as tests/test_plan_fsdp.py): LoRA under `parallel=fsdp` and
  `parallel=ddp` (the dense sizes with checkpointing under fsdp too; dense Qwen3.5's QLoRA under ddp; QLoRA under
  fsdp, the base as rows: Qwen3.5 nf4, Gemma 4 int8 with its per-layer projection quantized in the root; Gemma 4
  MoE's router and Qwen3.5's head trained under fsdp (modules_to_save), their frozen copies whole on each rank;
  full fine-tuning under fsdp, and Qwen3.5's under ddp), rank 0's
  shards (or whole model) and AdamW state equal to the plan's persistent terms to the byte, and its measured step
  peak plus those within 20% of the plan;
- the tool plans a rank of a Qwen3.5 folder; what the plan does not model under several ranks is one line.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from test_plan import (ALL, DELTANET, EXPERTS, GEMMA4, GEMMA4_MOE, QWEN3_5, ROOT, build, hf_config, plan_cli,
                       qwen3_5_moe_config)
from test_plan_moe import Images, check_two_ranks
from test_plan_vision import FAMILIES as VISION_FAMILIES
from test_plan_vision import GEMMA4_AUDIO, GEMMA4_VISION, IMAGE, gemma4_batch, image_batch

from minitrain.errors import UserError
from minitrain.plan import sharded
from minitrain.plan.predict import predict, shape_from_hf
from minitrain.plan.run_shape import RunShape

CONFIGS = {"qwen3_5": lambda: hf_config(**QWEN3_5), "qwen3_5_moe": qwen3_5_moe_config,
           "gemma4": lambda: hf_config(**GEMMA4), "gemma4_moe": lambda: hf_config(**GEMMA4_MOE)}
TARGETS = {"qwen3_5": ALL + DELTANET, "qwen3_5_moe": ALL + DELTANET + EXPERTS, "gemma4": ("all-linear",),
           "gemma4_moe": ALL + ("experts.gate_up_proj",), "qwen3_5_vl": ALL + DELTANET, "gemma4_vl": ALL}


@functools.cache
def vl_config(family: str) -> dict:
    """A multimodal folder's config.json as transformers writes it: tests/test_plan_vision.py's Qwen3.5 and its
    Gemma 4 (test_plan's language model, a tower of 16-pixel patches pooled 4 x 4)."""
    d = Path(tempfile.mkdtemp())
    if family == "gemma4_vl":  # (as test_plan_vision's `gemma4` fixture)
        text = {k: v for k, v in hf_config(**GEMMA4, vocab_size=160).items() if k != "model_type"}
        transformers.Gemma4Config(text_config=text, vision_config=GEMMA4_VISION, audio_config=GEMMA4_AUDIO,
                                  image_token_id=IMAGE, video_token_id=151, audio_token_id=154, boi_token_id=152,
                                  eoi_token_id=153, boa_token_id=155, eoa_token_index=156).save_pretrained(d)
    else:
        VISION_FAMILIES["qwen3_5"]().save_pretrained(d)
    out = json.loads((d / "config.json").read_text())
    shutil.rmtree(d)
    return out

# the shards only: Qwen3.5's attention_bias (the gated q_proj's bias 2 x the heads wide; none on DeltaNet's), a
# 31B-shaped Gemma 4 (no per-layer inputs, no kv-shared layers)
SHARDED = {**CONFIGS, "qwen3_5 bias": lambda: hf_config(**QWEN3_5, attention_bias=True),
           "gemma4 31b": lambda: hf_config(**{**GEMMA4, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
                                              "use_double_wide_mlp": False}),
           "qwen3_5_vl": lambda: vl_config("qwen3_5_vl"), "gemma4_vl": lambda: vl_config("gemma4_vl")}


def rows(t: torch.Tensor, world: int) -> int:
    """Bytes of rank 0's shard of `t`: torch.chunk's first piece of dim 0, as FSDP2 cuts it."""
    return torch.chunk(t, world)[0].nbytes


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(SHARDED))
def test_shards_exact_against_the_built_model(name, world):
    """Every parameter of each block and of the root, frozen and trained, as the plan lists them, against the model
    built from config.json with LoRA on the family's linears (Gemma 4: all-linear, its root's projection too; a
    multimodal folder's root: its tower, by the shapes the model holds, Gemma 4's (2, positions, Dv) table too)."""
    hf, targets = SHARDED[name](), TARGETS[name.split()[0]]
    model = build(hf, torch.float32, targets, r=8)
    run = RunShape(rows=world, seq=8, compute="fp32", lora_r=8, lora_targets=targets, world=world,
                   parallel="fsdp")
    root, blocks = sharded.parameters(shape_from_hf(hf), run)
    layers = [m for m in model.modules() if isinstance(m, tuple(model.block_types))]  # (what `fsdp.shard` wraps)
    assert len(blocks) == len(layers)
    for layer, planned in zip(layers, blocks):
        for trained in (False, True):
            held = [p for p in layer.parameters() if p.requires_grad == trained]
            assert sorted(rows(p, world) for p in held) == sorted(
                t.shard_bytes(world) for t in planned if t.trainable == trained), (name, trained)
    in_blocks = {id(p) for layer in layers for p in layer.parameters()}
    held = [p for p in model.parameters() if id(p) not in in_blocks]
    assert sorted((rows(p, world), p.requires_grad) for p in held) == sorted(
        (t.shard_bytes(world), t.trainable) for t in root)


def test_runs_the_plan_does_not_model_on_several_ranks_are_one_line():
    vl = shape_from_hf(vl_config("qwen3_5_vl"))
    with pytest.raises(UserError, match=r"\(not finetune=full on several ranks\)"):
        predict(vl, RunShape(rows=2, seq=8, full=True, world=2, parallel="ddp"))
    with pytest.raises(UserError, match="not quantize=nf4 under fsdp: the tower's linears are quantized by rows too"):
        predict(vl, RunShape(rows=2, seq=8, quantize="nf4", world=2, parallel="fsdp"))


def test_plan_tool_plans_a_rank_of_a_qwen3_5_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config(**QWEN3_5)))
    args = (str(ROOT / "recipes" / "sft_llama.py"), f"model={tmp_path}", "data=x.jsonl", "batch_size=4", "max_len=256",
            "--world", "2", "--parallel", "fsdp", "--device", "cpu")
    out = plan_cli(*args)
    assert out.returncode == 0, out.stderr
    assert "rank 0 of 2 (fsdp)" in out.stdout and "weights: 1/N shard (FSDP2)" in out.stdout
    qlora = plan_cli(*args, "quantize=nf4")
    assert qlora.returncode == 0 and "nf4 bytes" in qlora.stdout, qlora.stderr
    (tmp_path / "config.json").write_text(json.dumps(qwen3_5_moe_config()))
    moe = plan_cli(*args, "quantize=nf4")  # the MoE size: each rank's experts quantized, E first
    assert moe.returncode == 0 and "nf4 bytes" in moe.stdout, moe.stderr


# ----------------------------------------------------------------------------- 2 ranks, measured

# rank 0's planned / measured peak when written (fsdp, ddp, fsdp with checkpointing): Qwen3.5 1.009-1.020, 1.004,
# 1.039 (QLoRA under ddp, nf4 linears as the loader's hook makes them: 1.005); its MoE size 1.014-1.024, 1.014;
# Gemma 4 1.022, 1.014, 1.108; its MoE size 0.946-1.025 (three runs), 1.025
# QLoRA under fsdp (the base as rows, `quant_rows`: Qwen3.5 nf4, Gemma 4 int8, whose per-layer projection reads
# P = 32 inputs, not a whole nf4 block): 1.018-1.038, 1.003
# QLoRA of the MoE sizes under fsdp (each rank's experts quantized, E first: Qwen3.5 nf4, Gemma 4 int8): 1.043, 1.054
# Gemma 4's MoE size with its router trained (modules_to_save=router: proj, scale, per-expert scale) under fsdp: 1.001;
# full fine-tuning (fp32 master weights, gradients, AdamW): Qwen3.5 fsdp 1.016-1.020, ddp 1.012; Gemma 4 fsdp
# 0.988-1.039; its MoE size fsdp 0.929-0.978 (not kept, for the time: Qwen3.5's MoE size fsdp 1.008, Gemma 4 ddp
# 1.028, its MoE size ddp 0.997)
# the head trained (modules_to_save=lm_head) under fsdp: cut by rows, its frozen copy whole on each rank: 1.032
MORE = {"qwen3_5": ("qlora ddp", "lora fsdp ckpt", "qlora fsdp", "full fsdp", "full ddp", "head fsdp"),
        "qwen3_5_moe": ("qlora fsdp",),
        "gemma4": ("lora fsdp ckpt", "int8 fsdp", "full fsdp"),
        "gemma4_moe": ("router fsdp", "full fsdp", "int8 fsdp")}
RANKS = {name: (CONFIGS[name], TARGETS[name], ("lora fsdp", "lora ddp") + MORE.get(name, ())) for name in CONFIGS}
# multimodal folders (LoRA on the language model, the tower frozen in FSDP2's root), on image rows (row 1 padded;
# Gemma 4's 16 images of 4 soft tokens a row): Qwen3.5 fsdp 1.031-1.124, Gemma 4 fsdp 1.099 (not kept, for the
# time: Qwen3.5 ddp 1.103, Gemma 4 ddp 1.103, Gemma 4 with large images and checkpointing under fsdp 1.195)
RANKS["qwen3_5_vl"] = (lambda: vl_config("qwen3_5_vl"), TARGETS["qwen3_5_vl"], ("lora fsdp",),
                       Images(lambda: image_batch("qwen3_5")))
RANKS["gemma4_vl"] = (lambda: vl_config("gemma4_vl"), TARGETS["gemma4_vl"], ("lora fsdp",),
                      Images(lambda: gemma4_batch(8, 16), dict(max_soft_tokens=4)))


def test_two_ranks_measured_against_the_plan(tmp_path):
    check_two_ranks(tmp_path, "test_plan_ranks")


def test_a_torchrun_run_checks_each_ranks_memory(hf_causal, tmp_path):
    """Through the command, `python -m torch.distributed.run --nproc_per_node 2 -m minitrain recipes/sft.py` on a Qwen3.5
    folder under `parallel=fsdp` with `gpu_mem=` (the budget a CUDA run reads from its device): the run's memory
    check now plans each rank's share, where it skipped the plan with a note before. A budget that holds it: the
    planned per-rank peak is logged and the run trains (cut after step 1 and resumed with resume=true, the
    ranks' collective sequences equal in each launch: `test_torchrun_resume.launch`); one that does not: one line on rank 0's stderr and exit 2,
    nothing written under out/."""
    import shutil

    from _tok import corpus, make_bpe_tokenizer
    from test_qwen3_5 import QWEN35
    from test_torchrun_resume import _env, command, launch

    model = tmp_path / "model"
    shutil.copytree(hf_causal("qwen3_5", **QWEN35), model)  # (tests/test_qwen3_5.py's folder)
    make_bpe_tokenizer(model)
    lines = corpus(16, seed=5)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": lines[2 * i], "completion": " " + lines[2 * i + 1]}) + "\n"
                            for i in range(8)))
    args = [str(ROOT / "recipes" / "sft.py"), f"model={model}", f"data={data}", "eval_data=", "max_steps=2",
            "batch_size=2", "max_len=64", "parallel=fsdp", "device=cpu", "save_every=1"]
    fits = [*args, f"out={tmp_path / 'fits'}", "gpu_mem=8GiB"]
    for p in (launch(2, [*fits, "stop_after=1"]), launch(2, [*fits, "resume=true"])):  # cut after step 1, resumed
        assert "memory: planned peak" in p.stdout and "fits: gpu_mem=8GiB gives" in p.stdout, p.stdout[-2000:]
        assert "memory plan skipped" not in p.stdout + p.stderr
    steps = [json.loads(x)["step"] for x in (tmp_path / "fits" / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(x)]
    assert steps == [1, 2] and (tmp_path / "fits" / "adapter").is_dir()
    # the ranks exit 2; torch's launcher then reports their exit codes (its own traceback) and exits 1
    p = subprocess.run(command(2, [*args, f"out={tmp_path / 'small'}", "gpu_mem=1MiB"]), cwd=ROOT, env=_env(None),
                       capture_output=True, text=True, timeout=600)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode != 0 and "exitcode: 2" in p.stderr, p.stderr[-3000:]
    assert len(errors) == 1 and "memory: the plan needs" in errors[0] and "gpu_mem=1MiB gives" in errors[0], p.stderr
    assert "minitrain/" not in p.stderr.partition("Traceback")[2]  # no traceback from our code: only the launcher's
    assert not (tmp_path / "small").exists() or not any((tmp_path / "small").iterdir())
