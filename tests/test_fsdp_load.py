"""parallel=fsdp without the whole model on any rank: the sharded load and the file-by-file save.

- Each of 2 ranks (gloo, CPU) builds the model on meta, shards it and reads only its rows of each
  tensor (`minitrain.parallel.fsdp.prepare`): gathered back, every tensor equals `load_pretrained`'s whole
  one bit for bit (a tied head, a vocabulary of odd rows so the two shards differ in size, a
  checkpoint in several files, fp32 read in place and bf16 through a cast), and each rank read
  about half the checkpoint's bytes.
- `fsdp.save_model` writes an HF folder from the shards one file at a time: the same files, index
  and tensors as `weights.save_pretrained` from the whole model.
- Through torchrun and the CLI: LoRA with `modules_to_save` and an EMA under parallel=fsdp saves the
  adapter one process saves (the trained lm_head: it used to save the base's), and continuing that
  adapter (`init_adapter`) under fsdp equals one process too; so does `eval_only=true`.
- QLoRA under FSDP2: an nf4 and an int8 base (bitsandbytes' CPU kernels) sharded over 2 ranks, each
  holding about half of the quantized bytes, trains the adapter the one-process QLoRA run trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import REPO, cli_args, launch, max_abs_diff

from minitrain.parallel import fsdp
from minitrain.weights import INDEX_FILE, load_pretrained, open_pretrained, save_pretrained

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory) -> Path:
    """A tiny tied LLaMA with 257 vocabulary rows, saved by transformers in several files."""
    import transformers
    from conftest import TINY_LLAMA

    cfg = transformers.LlamaConfig(**{**TINY_LLAMA, "vocab_size": 257, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("fsdp_load") / "model"
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="40KB")
    assert (folder / INDEX_FILE).is_file()  # several files
    return folder


def build(config: dict) -> torch.nn.Module:
    sys.path.insert(0, str(REPO))
    from models import from_hf_config

    return from_hf_config(config)


def sharded_load_worker(rank: int, folder: str, out: str) -> None:
    folder, out = Path(folder), Path(out)
    for dtype in (torch.float32, torch.bfloat16):
        model, headers = open_pretrained(folder, build)
        fsdp.defer_weights(model, folder, headers, dtype, torch.device("cpu"))
        lines: list[str] = []
        fsdp.prepare(model, torch.device("cpu"), log=lines.append)
        held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        whole = fsdp.gather_whole(dict(model.named_parameters(remove_duplicate=False)))
        if rank == 0:
            from safetensors.torch import save_file

            name = str(dtype).removeprefix("torch.")
            save_file({k: v.contiguous() for k, v in whole.items() if k != "lm_head.weight"}, out / f"{name}.safetensors")
            tied = model.get_submodule("lm_head").weight is model.get_submodule("model.embed_tokens").weight
            (out / f"{name}.json").write_text(json.dumps({"log": lines, "tied": tied}))
        (out / f"held{rank}-{dtype}.txt").write_text(str(held))
        if dtype == torch.float32:  # the file-by-file save of the same shards
            fsdp.save_model(out / "saved", dict(model.named_parameters()), model.hf_config,
                            side_files=lambda tmp: None, dtype=torch.float32, max_shard_bytes=60_000)
            vocab_parallel_worker(model, rank, out)
        else:  # bf16 weights: the frozen head's low-precision path (whole blocks of this rank's columns)
            from safetensors.torch import save_file

            loss, hgrad = logits_loss(model, *rank_batch(rank), frozen=True)
            save_file({"loss": loss, "hgrad": hgrad.contiguous()}, out / f"vocab{rank}-bf16.safetensors")


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own (ids, labels): rank 0 2 x 5 tokens, rank 1 1 x 3 with no target at all."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 257, (2, 5) if rank == 0 else (1, 3), generator=g)
    if rank == 1:
        return ids, torch.full_like(ids, -100)
    return ids, torch.where(torch.rand(ids.shape, generator=g) < 0.8, ids, -100)


def logits_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, frozen: bool) -> tuple:
    """(loss sum, the gradient of the hidden states (frozen) or of the tied embedding / head (trained))."""
    from minitrain.objectives.losses import chunked_cross_entropy_sum

    hidden = model(ids)
    if frozen:
        hidden = hidden.detach().requires_grad_()
    loss, _ = chunked_cross_entropy_sum(hidden, model.output_projection, labels, chunk=4)
    if loss.requires_grad:  # (one process, no target: nothing to differentiate; a rank of a sharded head always is)
        loss.backward()
    grad = hidden.grad if frozen else model.output_projection.weight.grad
    if grad is None:
        grad = torch.zeros_like(hidden if frozen else model.output_projection.weight)
    return loss.detach(), grad


def vocab_parallel_worker(model: torch.nn.Module, rank: int, out: Path) -> None:
    """The embeddings and the tied head stay this rank's rows through a forward (FSDP2 leaves its root
    gathered after one: a root holding them would show the whole tensor here); the sharded lookup and
    loss, frozen then trained, on each rank's own batch."""
    from torch.distributed.tensor import DTensor

    emb, head = model.get_submodule("model.embed_tokens"), model.output_projection
    with torch.no_grad():
        model(rank_batch(rank)[0])
    rows = {n: [type(m.weight).__name__, m.weight.to_local().shape[0]] for n, m in (("embed", emb), ("head", head))}
    (out / f"rows{rank}.json").write_text(json.dumps(rows))
    ids, labels = rank_batch(rank)
    loss, hgrad = logits_loss(model, ids, labels, frozen=True)
    head.weight.requires_grad_(True)  # (the tied pair: the embedding's rows and the head's, one tensor)
    trained_loss, wgrad = logits_loss(model, ids, labels, frozen=False)
    assert isinstance(wgrad, DTensor)
    wgrad = wgrad.full_tensor()
    from safetensors.torch import save_file

    save_file({"loss": loss, "hgrad": hgrad.contiguous(), "trained_loss": trained_loss, "wgrad": wgrad},
              out / f"vocab{rank}.safetensors")


def test_each_rank_reads_its_rows_and_the_shards_make_the_whole_model(split_checkpoint, tmp_path):
    launch(tmp_path, "sharded_load_worker", str(split_checkpoint), str(tmp_path), module="test_fsdp_load")
    total = sum(p.stat().st_size for p in split_checkpoint.glob("*.safetensors"))
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        want = load_pretrained(split_checkpoint, build, dtype=dtype).state_dict()
        got = load_file(tmp_path / f"{name}.safetensors")
        assert set(got) == set(want) - {"lm_head.weight"} and all(torch.equal(got[k], want[k]) for k in got), name
        info = json.loads((tmp_path / f"{name}.json").read_text())
        assert info["tied"]  # the head is still the embedding after sharding
        read = [ln for ln in info["log"] if ln.startswith("sharded load: this rank read")]
        got_read = size_after(read[0], " read ")
        assert 0.4 * total <= got_read <= 0.6 * total, (read[0], total)  # about half, not the whole
        held = [int((tmp_path / f"held{r}-{dtype}.txt").read_text()) for r in (0, 1)]
        whole = sum(t.numel() * t.element_size() for k, t in want.items() if k != "lm_head.weight")
        assert all(h < 0.6 * whole for h in held) and sum(held) >= whole  # each rank holds its half (+ padding)

    # the embeddings and the tied head: each rank's rows after a forward, and the sharded lookup and loss
    # equal one process's, per rank (frozen: loss, hidden-state gradients) and summed (trained: the weight's)
    for r in (0, 1):
        assert json.loads((tmp_path / f"rows{r}.json").read_text()) == {"embed": ["DTensor", 129 - r],
                                                                          "head": ["DTensor", 129 - r]}
    whole = load_pretrained(split_checkpoint, build, dtype=torch.float32)
    got = [load_file(tmp_path / f"vocab{r}.safetensors") for r in (0, 1)]
    for r in (0, 1):
        loss, hgrad = logits_loss(whole, *rank_batch(r), frozen=True)
        assert torch.allclose(got[r]["loss"], loss, atol=1e-5) and torch.allclose(got[r]["hgrad"], hgrad, atol=1e-6)
    assert float(got[1]["loss"]) == 0.0 and float(got[0]["loss"]) > 1.0  # rank 1 had no target, and took part
    low = load_pretrained(split_checkpoint, build, dtype=torch.bfloat16)
    for r in (0, 1):  # bf16: the same products, rounded where one process rounds them
        loss, hgrad = logits_loss(low, *rank_batch(r), frozen=True)
        bf16 = load_file(tmp_path / f"vocab{r}-bf16.safetensors")
        assert torch.allclose(bf16["loss"], loss, rtol=1e-3) and torch.allclose(bf16["hgrad"], hgrad, atol=1e-3)
    whole.output_projection.weight.requires_grad_(True)
    trained = [logits_loss(whole, *rank_batch(r), frozen=False) for r in (0, 1)]
    assert all(torch.allclose(g["trained_loss"], t[0], atol=1e-5) for g, t in zip(got, trained))
    summed = whole.output_projection.weight.grad  # both batches' backward accumulated (as FSDP2's reduce-scatter sums)
    assert float(summed.abs().max()) > 1e-3 and all(torch.allclose(g["wgrad"], summed, atol=1e-6) for g in got)

    # fsdp.save_model from the shards == save_pretrained from the whole model: files, index, tensors
    ref = tmp_path / "ref"
    whole_model = load_pretrained(split_checkpoint, build, dtype=torch.float32)
    save_pretrained(whole_model, ref, whole_model.hf_config, dtype=torch.float32, max_shard_bytes=60_000)
    saved = tmp_path / "saved"
    files = sorted(p.name for p in saved.iterdir())
    assert files == sorted(p.name for p in ref.iterdir()) and len(files) > 3, files  # several shard files
    assert json.loads((saved / INDEX_FILE).read_text()) == json.loads((ref / INDEX_FILE).read_text())
    for f in saved.glob("*.safetensors"):
        a, b = load_file(f), load_file(ref / f.name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), f.name
    assert not list(tmp_path.glob("saved.tmp-*"))  # the temporary folder is gone


def size_after(line: str, word: str) -> float:
    """The size (`812.3 KiB`, `1.25 GiB`) that follows `word` in a log line, in bytes."""
    number, unit = line.split(word)[1].split()[:2]
    return float(number.replace(",", "")) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def torchrun(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "minitrain",
                        *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "Traceback" not in p.stderr
    return p


def test_fsdp_lora_with_modules_to_save_and_init_adapter_equal_one_process(tiny_model, tmp_path, capsys):
    from minitrain.cli import run_cli

    keys = ["modules_to_save=lm_head", "ema_decay=0.5", "lr=1e-2"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli(cli_args(tiny_model, one, *keys)) == 0, capsys.readouterr().err
    p = torchrun(cli_args(tiny_model, two, *keys, "parallel=fsdp"))
    assert "sharded over 2 ranks as it is read" in p.stdout
    base = load_file(tiny_model / "model.safetensors")["lm_head.weight"]
    for folder in ("adapter", "adapter_ema"):
        want = load_file(one / folder / "adapter_model.safetensors")
        got = load_file(two / folder / "adapter_model.safetensors")
        assert max_abs_diff(got, want) <= 1e-5, folder
        head = got["base_model.model.lm_head.weight"]
        assert float((head - base).abs().max()) > 1e-3, folder  # the trained head, not the base's

    def cont(out: Path, *extra: str) -> list[str]:  # one more step on the saved adapter
        args = [a for a in cli_args(tiny_model, out, *extra) if not a.startswith("max_steps=")]
        return args + ["init_adapter=" + str(one / "adapter"), "max_steps=1"]

    assert run_cli(cont(tmp_path / "one-b")) == 0, capsys.readouterr().err
    torchrun(cont(tmp_path / "two-b", "parallel=fsdp"))
    want = load_file(tmp_path / "one-b" / "adapter" / "adapter_model.safetensors")
    got = load_file(tmp_path / "two-b" / "adapter" / "adapter_model.safetensors")
    assert max_abs_diff(got, want) <= 1e-5
    assert max_abs_diff(got, load_file(one / "adapter" / "adapter_model.safetensors")) > 1e-4  # it trained on


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_qlora_under_fsdp_holds_half_the_base_and_equals_one_process(tiny_model, tmp_path, capsys, quantize):
    pytest.importorskip("bitsandbytes")
    from minitrain.cli import run_cli

    from test_torchrun_resume import launch

    keys = [f"quantize={quantize}", "lr=1e-2"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli(cli_args(tiny_model, one, *keys)) == 0, capsys.readouterr().err
    # cut after step 2 and resumed with resume=true (each launch: the ranks' collective sequences equal)
    for p in (launch(2, cli_args(tiny_model, two, *keys, "parallel=fsdp", "stop_after=2")),
              launch(2, cli_args(tiny_model, two, *keys, "parallel=fsdp", "resume=true"))):
        line = next(ln for ln in p.stdout.splitlines() if ln.startswith("sharded load:"))
        held, whole = size_after(line, " holds "), size_after(line, " model's ")
        assert 0.4 * whole <= held <= 0.6 * whole, line  # rank 0's half of the quantized base (and the rest)
    assert [json.loads(x)["step"] for x in (two / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(x)] == [1, 2, 3]
    want = load_file(one / "adapter" / "adapter_model.safetensors")
    got = load_file(two / "adapter" / "adapter_model.safetensors")
    assert max_abs_diff(got, want) <= 5e-5
    start_b = max(float(t.abs().max()) for k, t in got.items() if "lora_B" in k)
    assert start_b > 1e-3  # B moved off zero: the adapter trained


def test_eval_only_under_fsdp_reads_the_shards_and_equals_one_process(tiny_model, tmp_path, capsys):
    from minitrain.cli import run_cli

    keys = ["eval_only=true", "eval_split=0.5"]
    assert run_cli(cli_args(tiny_model, tmp_path / "one", *keys)) == 0, capsys.readouterr().err
    torchrun(cli_args(tiny_model, tmp_path / "two", *keys, "parallel=fsdp"))
    want, got = ([json.loads(ln) for ln in (tmp_path / d / "eval.jsonl").read_text().splitlines()] for d in ("one", "two"))
    assert len(got) == len(want) == 1 and got[0]["step"] == 0
    assert got[0]["eval/loss"] == pytest.approx(want[0]["eval/loss"], rel=1e-5)


def test_t5_with_generation_eval_under_fsdp_equals_ddp(tmp_path):
    """T5's stacks read block 0's position table before the blocks run: `used_outside_blocks` keeps
    that block with the root (it failed with "mixed torch.Tensor and DTensor" before). ROUGE evaluations
    before and between the steps: every rank generates, the root's blocks still train after them
    (they stayed at zero before `fsdp.reshard`), rank 0 alone writes the predictions and the best
    adapter (gathered from the shards), each evaluation logged once."""
    from test_lora_t5 import corpus, save_tiny_t5, write_rows

    model, data = save_tiny_t5(tmp_path / "t5"), write_rows(tmp_path / "train.jsonl", corpus(8, seed=5))
    val = write_rows(tmp_path / "val.jsonl", corpus(4, seed=6))
    args = [str(REPO / "recipes" / "lora_t5.py"), f"model={model}", f"data={data}", "max_steps=2", "batch_size=2",
            "precision=fp32", 'fields={"prompt": "question", "completion": "answer"}', "save_every=0",
            f"eval_data={val}", "eval_every=1", "patience=3", "max_new_tokens=4"]
    for parallel in ("ddp", "fsdp"):
        p = torchrun([*args, f"out={tmp_path / parallel}", f"parallel={parallel}"])
        assert sum(ln.startswith("step 1: eval/rouge1") for ln in p.stdout.splitlines()) == 1, p.stdout
    for folder in ("adapter", "best_adapter"):
        want, got = (load_file(tmp_path / p / folder / "adapter_model.safetensors") for p in ("ddp", "fsdp"))
        assert max_abs_diff(got, want) <= 1e-5, folder
        assert (tmp_path / "fsdp" / folder / "tokenizer_config.json").is_file()
    b = {k: t for k, t in want.items() if k.endswith("lora_B.weight") and ".block.0." in k}
    assert b and all(float(t.abs().max()) > 0 for t in b.values())  # the root's blocks trained
    for parallel in ("ddp", "fsdp"):
        rows = (tmp_path / parallel / "predictions" / "step_0000002.jsonl").read_text().splitlines()
        assert len(rows) == 4


def test_evaluations_between_steps_under_fsdp_equal_one_process(tiny_model, tmp_path, capsys):
    """An evaluation (no_grad forwards) before and between steps leaves FSDP's root gathered; the next
    step must still reduce the root's gradients (the trained head here) into its shards."""
    from minitrain.cli import run_cli

    keys = ["modules_to_save=lm_head", "lr=1e-2", "eval_split=0.25", "eval_every=1"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli(cli_args(tiny_model, one, *keys)) == 0, capsys.readouterr().err
    torchrun(cli_args(tiny_model, two, *keys, "parallel=fsdp"))
    want = load_file(one / "adapter" / "adapter_model.safetensors")
    got = load_file(two / "adapter" / "adapter_model.safetensors")
    assert max_abs_diff(got, want) <= 1e-5
    rows = {d: [json.loads(ln) for ln in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("one", "two")}
    for a, b in zip(rows["one"], rows["two"], strict=True):
        assert b["eval/loss"] == pytest.approx(a["eval/loss"], rel=1e-5)
