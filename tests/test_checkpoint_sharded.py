"""Sharded checkpoints (FSDP2): each rank writes its own part, and a run resumes at another world
size and in another mode as the same run. CPU, gloo, the tiny model of test_train.

Four runs are cut twice and finished in one process (`parallel=ddp`), each compared with the
same run uninterrupted in one process (trained tensors within 1e-5, every metrics row alike):

    full   full fine-tune   fsdp x 2 -> fsdp x 4 -> 1 process
    lora   LoRA r=4         fsdp x 2 -> fsdp x 4 -> 1 process
    mixed  LoRA r=2, EMA,   ddp  x 2 -> fsdp x 4 -> 1 process   (ddp -> fsdp; batch 6 over 4 ranks:
           batch 6                                                2 + 2 + 1 + 1, then 1 + 1 + 1 + 0;
                                                                  lora_A's 2 rows: ranks 2, 3 hold none)
    back   full fine-tune   fsdp x 2 -> ddp  x 4 -> 1 process   (fsdp -> ddp at several ranks)

Also: each rank's part holds its ~1/N of the rows (no rank wrote the whole), every file of a
checkpoint is safetensors or JSON (no pickle), a checkpoint lacking a part is one line on every
rank, a write failing on one rank (or landing where rank 0 does not see it: out= not shared) is
one line on every rank with the previous checkpoint kept,
and a rank SIGKILLed in the middle of a save leaves the previous checkpoint whole (the run then
resumes from it, in one process, to the uninterrupted result).

Two launches in all (2 processes, then 4), each running every case in turn, to keep the
interpreter starts few.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_distributed import TRAIN, lora_model, max_abs_diff
from test_train import TinyLM, cfg_for, collate, quiet, rows, trainable_state

from minitrain import checkpoint as ckpt
from minitrain.parallel import checkpoint_shards as shards
from minitrain import ema
from minitrain.parallel import distributed, fsdp
from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.errors import UserError
from minitrain.objectives.sft import sft
from minitrain.train import Interrupted, build_optimizer, train

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# name: (model, config keys, [(parallel, world, stop after step)] for the two cut phases)
CASES = {
    "full": ("full", {}, [("fsdp", 2, 2), ("fsdp", 4, 4)]),
    "lora": ("lora4", {}, [("fsdp", 2, 2), ("fsdp", 4, 4)]),
    "mixed": ("lora2", {"batch_size": 6, "grad_accum": 1, "ema_decay": 0.9}, [("ddp", 2, 2), ("fsdp", 4, 5)]),
    "back": ("full", {}, [("fsdp", 2, 2), ("ddp", 4, 4)]),
}


def make_model(kind: str) -> torch.nn.Module:
    if kind == "full":
        return TinyLM()
    if kind == "lora4":
        return lora_model()
    model = TinyLM()
    model.model.embed_tokens.weight.requires_grad_(False)
    torch.manual_seed(1)
    cfg = LoRAConfig(r=2, alpha=4.0, targets=["q_proj", "v_proj", "up_proj", "down_proj"])
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    return model


def config(out: Path, case: str, **kw):
    keys = {"batch_size": 4, "grad_accum": 2, **CASES[case][1]}
    return cfg_for(out, lr=1e-2, max_grad_norm=0.2, epochs=2.0, skip_audit=True, out=str(out), **{**keys, **kw})


def launch(tmp_path: Path, world: int, fn: str, *args, killed: int | None = None) -> list[int]:
    """Run `fn(rank, world, *args)` of this module in `world` processes joined by gloo; their exit codes.
    When one dies, the others are stopped (as torchrun does). Any failure fails the test with the
    processes' stderr, except that rank `killed` is meant to SIGKILL itself (the others then fail)."""
    code = (f"import sys, torch, torch.distributed as dist\n"
            f"sys.path[:0] = [{str(HERE)!r}, {str(REPO)!r}]\n"
            f"torch.set_num_threads(1)\n"
            f"rank = int(sys.argv[1])\n"
            f"dist.init_process_group('gloo', init_method={'file://' + str(tmp_path / f'rdv-{fn}-{world}')!r}, "
            f"rank=rank, world_size={world})\n"
            f"import test_checkpoint_sharded as t\n"
            f"t.{fn}(rank, {world}, *{args!r})\n"
            f"dist.destroy_process_group()\n"
            f"sys.stdout.flush(); sys.stderr.flush()\n"
            f"import os; os._exit(0)\n")  # no interpreter finalisation under gloo (see test_distributed)
    errs = [open(tmp_path / f"{fn}-{world}-{r}.err", "w") for r in range(world)]  # noqa: SIM115
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stderr=errs[r], text=True) for r in range(world)]
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):  # one died: the others would wait for it
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    for f in errs:
        f.close()
    codes = [p.wait() for p in procs]
    if (codes[killed] != -signal.SIGKILL) if killed is not None else any(codes):
        raise AssertionError("\n".join((tmp_path / f"{fn}-{world}-{r}.err").read_text()[-3000:] for r in range(world)))
    return codes


def cut_run(rank: int, root: Path, case: str, phase: int) -> None:
    """Phase 0 starts the case's run, phase 1 resumes it; each stops (SIGTERM) after its step."""
    parallel, _, stop = CASES[case][2][phase]
    cfg = config(root / case, case, parallel=parallel, resume=phase > 0)
    start = json.loads((root / case / "checkpoint" / "state.json").read_text())["step"] if phase else 0
    calls = [0]

    def sigterm_at_step(model, batch):  # in the first micro-batch of step `stop`: the run stops after it
        calls[0] += 1
        if rank == 0 and calls[0] == (stop - start - 1) * cfg.grad_accum + 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return sft(model, batch)

    lines: list[str] = []
    try:
        train(make_model(CASES[case][0]), sigterm_at_step, TRAIN, collate, cfg, log=lines.append)
        raise AssertionError("not interrupted")
    except Interrupted as e:
        assert e.step == stop
    if rank == 0:
        (root / f"{case}-{phase}.log").write_text("\n".join(lines))


def phase_two(rank: int, world: int, root: str) -> None:
    root = Path(root)
    for case in CASES:
        cut_run(rank, root, case, 0)
    distributed.gather_objects(None)  # every case written before the kill below
    # a save SIGKILLed on rank 1 after it wrote its weights part (the save of step 2): rank 0 waits in the
    # save until the launcher kills it, as torchrun would
    real, n = shards.write_part, [0]

    def dies_mid_save(path, *a):
        real(path, *a)
        n[0] += 1
        if rank == 1 and n[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    shards.write_part = dies_mid_save
    cfg = config(root / "killed", "lora", parallel="fsdp", save_every=1)
    train(make_model("lora4"), sft, TRAIN, collate, cfg, log=quiet)
    raise AssertionError("rank 1 was not killed")


def phase_four(rank: int, world: int, root: str) -> None:
    root = Path(root)
    for case in CASES:
        cut_run(rank, root, case, 1)

    # a checkpoint lacking a part: the same one line on every rank (rank 0 looked)
    refused(root, rank, "missing", lambda: ckpt.load(root / "missing", [], None))

    # a write failing on rank 2 alone: one line on every rank, no tmp left, the previous checkpoint kept
    model = TinyLM()
    fsdp.shard(model, torch.device("cpu"))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = build_optimizer(named, 0.0, 1e-2)
    out = root / "disk_full"
    ckpt.save(out, named, optimizer, {"step": 1})
    real = shards.write_part

    def full_disk(path, *a):
        if rank == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, *a)

    def elsewhere(path, *a):  # rank 3 on a machine whose out= is another folder: rank 0 misses its part
        real(root / "elsewhere" / path.name if rank == 3 else path, *a)

    other_layouts(rank, world, str(root))
    (root / "elsewhere").mkdir(exist_ok=True)
    for name, write, step in (("disk_full", full_disk, 2), ("not_shared", elsewhere, 3)):
        shards.write_part = write
        try:
            refused(root, rank, name, lambda: ckpt.save(out, named, optimizer, {"step": step}))  # noqa: B023
        finally:
            shards.write_part = real


def other_layouts(rank: int, world: int, root: str) -> None:
    """A DTensor not sharded on rows (replicated) is written whole by rank 0 beside a row-sharded one,
    and each comes back as it was laid out; a plain (whole) target gets the whole of both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    a, b = torch.randn(5, 3), torch.randn(2, 4)
    named = [("rows", torch.nn.Parameter(distribute_tensor(a, mesh, [Shard(0)]))),
             ("copies", torch.nn.Parameter(distribute_tensor(b, mesh, [Replicate()])))]
    ckpt.save(Path(root) / "layouts", named, build_optimizer(named, 0.0, 1e-2), {"step": 1})
    back = [(n, torch.nn.Parameter(torch.zeros_like(p))) for n, p in named]
    ckpt.load(Path(root) / "layouts", back, build_optimizer(back, 0.0, 1e-2))
    plain = [("rows", torch.nn.Parameter(torch.zeros(5, 3))), ("copies", torch.nn.Parameter(torch.zeros(2, 4)))]
    ckpt.load(Path(root) / "layouts", plain, build_optimizer(plain, 0.0, 1e-2))
    same = [torch.equal(back[0][1].full_tensor(), a), torch.equal(back[1][1].to_local(), b),
            torch.equal(plain[0][1].detach(), a), torch.equal(plain[1][1].detach(), b)]
    (Path(root) / f"layouts-{rank}.json").write_text(json.dumps(same))


def refused(root: Path, rank: int, name: str, fn) -> None:
    """`fn()` must raise a UserError: its line and whether every rank raises it go to `<name>-<rank>.json`."""
    try:
        fn()
        raise AssertionError("not refused")
    except UserError as e:
        (root / f"{name}-{rank}.json").write_text(json.dumps([str(e), getattr(e, "shared", False)]))


def parts_rows(folder: Path, stem: str) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """{tensor: (its whole row count, [(first row, rows) of each part that holds some, in rank order])},
    from the parts' headers."""
    state = json.loads((folder / "state.json").read_text())
    out: dict[str, tuple[int, list[tuple[int, int]]]] = {}
    for r in range(state["parts"]):
        with safe_open(str(folder / shards.part_file(stem, r)), "pt") as f:
            meta = f.metadata()
            assert meta["rank"] == str(r) and meta["parts"] == str(state["parts"])
            where = json.loads(meta["rows"])
            for name in f.keys():  # noqa: SIM118 (a safe_open handle)
                start, n = where[name][:2]
                out.setdefault(name, (n, []))[1].append((start, f.get_slice(name).get_shape()[0]))
    return out


def assert_only_safetensors_and_json(folder: Path) -> None:
    """Every file parses as JSON, or is safetensors through and through: an 8-byte length, a JSON header,
    then exactly the tensors' bytes it lists (nothing else, so nothing that unpickles)."""
    for path in folder.iterdir():
        data = path.read_bytes()
        if path.suffix == ".json":
            json.loads(data)
            continue
        assert path.suffix == ".safetensors", path
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        assert len(data) == 8 + n + max(ends, default=0), path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case cut at 2 ranks then at 4 (each phase's checkpoint kept), and the references."""
    root = tmp_path_factory.mktemp("sharded")
    launch(root, 2, "phase_two", str(root), killed=1)  # rank 1 dies in a save at the end
    for case in CASES:
        shutil.copytree(root / case / "checkpoint", root / "after2" / case)
    (root / "missing").mkdir()
    shutil.copytree(root / "lora" / "checkpoint", root / "missing" / "checkpoint")
    (root / "missing" / "checkpoint" / "weights.rank1.safetensors").unlink()
    launch(root, 4, "phase_four", str(root))
    for case in CASES:
        shutil.copytree(root / case / "checkpoint", root / "after4" / case)
    refs = {}
    for kind in ("full", "lora", "mixed"):  # uninterrupted, one process ("back" is "full"'s run)
        model = make_model(CASES[kind][0])
        train(model, sft, TRAIN, collate, config(root / f"ref-{kind}", kind), log=quiet)
        refs[kind] = {**trainable_state(model), **{f"ema/{k}": v for k, v in (ema.whole(model) or {}).items()}}
    refs["back"] = refs["full"]
    return root, refs


def finish_in_one_process(root: Path, case: str, out: str | None = None) -> tuple[dict, list[str]]:
    """The run resumed in one process (ddp) to its end: its trained tensors (and EMA) and log lines."""
    model, lines = make_model(CASES[case][0]), []
    train(model, sft, TRAIN, collate, config(root / (out or case), case, resume=True), log=lines.append)
    return {**trainable_state(model), **{f"ema/{k}": v for k, v in (ema.whole(model) or {}).items()}}, lines


def assert_same_run(got_dir: Path, want_dir: Path) -> None:
    got, want = rows(got_dir), rows(want_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert {k: g[k] for k in ("tokens", "target_tokens", "epoch", "lr")} == \
               {k: w[k] for k in ("tokens", "target_tokens", "epoch", "lr")}
        for k in ("loss", "grad_norm"):
            assert g[k] == pytest.approx(w[k], rel=1e-5), (g["step"], k)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resumed_at_other_world_sizes_and_modes_equals_the_uninterrupted_run(runs, case):
    root, refs = runs
    start = trainable_state(make_model(CASES[case][0]))
    assert max_abs_diff({k: v for k, v in refs[case].items() if k in start}, start) > 1e-3  # training moved the tensors: the comparison means something
    got, lines = finish_in_one_process(root, case)
    assert max_abs_diff(got, refs[case]) <= 1e-5
    assert_same_run(root / case, root / f"ref-{case if case != 'back' else 'full'}")
    # each world-size change said what it means, once
    note = "this run has {}: it continues the same run, except that random draws (dropout masks, sampling) differ"
    assert note.format(4) in (root / f"{case}-1.log").read_text()
    assert sum(note.format(1) in ln for ln in lines) == 1


@pytest.mark.slow
def test_each_rank_writes_its_own_rows_and_no_file_is_a_pickle(runs):
    root, _ = runs
    for case, world in (("full", 2), ("lora", 2), ("back", 2), ("full", 4), ("lora", 4), ("mixed", 4)):
        folder = root / f"after{world}" / case
        assert_only_safetensors_and_json(folder)
        state = json.loads((folder / "state.json").read_text())
        assert state["parts"] == world and state["world_size"] == world
        assert not (folder / "weights.safetensors").exists()
        stems = ("weights", "optimizer", "ema") if case == "mixed" else ("weights", "optimizer")
        assert {p.name for p in folder.iterdir()} == {
            "state.json", "rng.safetensors", *(f"rng.rank{r}.safetensors" for r in range(1, world)),
            *(shards.part_file(s, r) for s in stems for r in range(world))}
        for stem in stems:
            for name, (n, pieces) in parts_rows(folder, stem).items():
                size = -(-n // world)
                # torch.chunk's rows, each block in its own rank's part, together the whole tensor once
                assert pieces == [(s, min(size, n - s)) for s in range(0, n, size)], (case, stem, name)
                assert n == 1 or all(k < n for _, k in pieces)  # no rank wrote the whole
    for case in ("mixed",):  # saved by ddp x 2: whole files
        folder = root / "after2" / case
        assert_only_safetensors_and_json(folder)
        assert (folder / "weights.safetensors").is_file() and (folder / "ema.safetensors").is_file()
        assert "parts" not in json.loads((folder / "state.json").read_text())
    folder = root / "after4" / "back"  # saved by ddp x 4
    assert (folder / "weights.safetensors").is_file() and (folder / "rng.rank3.safetensors").is_file()
    # what a resume checks before it writes anything reads the parts' headers: every tensor's whole shape
    assert ckpt.saved_shapes(root / "after2" / "full") == {n: tuple(p.shape) for n, p in TinyLM().named_parameters()}
    # 2 ranks of the full fine-tune wrote about half the tensor bytes each
    sizes = [tensor_bytes(root / "after2" / "full" / shards.part_file("weights", r)) for r in (0, 1)]
    whole = sum(p.numel() * 4 for p in TinyLM().parameters())
    assert sum(sizes) == whole and all(0.4 * whole < s < 0.6 * whole for s in sizes), (sizes, whole)


def tensor_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


@pytest.mark.slow
def test_a_tensor_of_another_layout_is_written_whole_by_rank_0_and_restored(runs):
    root, _ = runs
    assert all(json.loads((root / f"layouts-{r}.json").read_text()) == [True] * 4 for r in range(4))
    parts = parts_rows(root / "layouts" / "checkpoint", "weights")
    assert parts["rows"] == (5, [(0, 2), (2, 2), (4, 1)]) and parts["copies"] == (2, [(0, 2)])
    with safe_open(str(root / "layouts" / "checkpoint" / "weights.rank0.safetensors"), "pt") as f:
        assert "copies" in f.keys()  # noqa: SIM118 (rank 0's part)


@pytest.mark.slow
def test_a_missing_part_is_one_line_on_every_rank(runs, tmp_path):
    root, _ = runs
    got = [json.loads((root / f"missing-{r}.json").read_text()) for r in range(4)]
    assert all(g == got[0] for g in got) and got[0][1] is True  # the same error on every rank; rank 0 prints it
    message = got[0][0]
    assert "\n" not in message and UserError.exit_code == 2
    assert message.startswith(f"{root / 'missing' / 'checkpoint' / 'weights.rank1.safetensors'}: missing — the "
                              f"checkpoint was saved by 2 ranks, each writing its own part")
    assert "out= must be a folder every machine sees" in message and "overwrite=true" in message
    with pytest.raises(UserError) as e:  # one process: the same line, before anything is restored
        finish_in_one_process(root, "lora", out="missing")
    assert str(e.value) == message


@pytest.mark.slow
def test_a_write_failing_or_unseen_on_one_rank_is_one_line_everywhere_and_keeps_the_previous_checkpoint(runs):
    root, _ = runs
    got = [json.loads((root / f"disk_full-{r}.json").read_text()) for r in range(4)]
    assert all(g == got[0] for g in got) and got[0][1] is True
    out = root / "disk_full"
    assert got[0][0] == (f"{out / 'checkpoint'}: cannot write the checkpoint: no space left on device (rank 2) — free "
                         f"space or make {out} writable, then rerun with resume=true to continue from the last "
                         f"complete checkpoint (step 1)")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint"]  # no checkpoint.tmp-* left
    assert ckpt.saved_step(out / "checkpoint") == 1
    # a rank writing where rank 0 does not see it (out= not shared between machines): the same
    got = [json.loads((root / f"not_shared-{r}.json").read_text()) for r in range(4)]
    assert all(g == got[0] for g in got) and got[0][1] is True
    assert re.fullmatch(re.escape(f"{out / 'checkpoint'}: rank 0 does not see weights.rank3.safetensors, which rank "
                                  f"3 wrote into checkpoint.tmp-") + r"\d+ — out= must be a folder every machine sees "
                        r"\(a shared filesystem\), then rerun", got[0][0]), got[0][0]
    assert (root / "elsewhere" / "weights.rank3.safetensors").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint"] and ckpt.saved_step(out / "checkpoint") == 1


@pytest.mark.slow
def test_a_rank_killed_during_a_sharded_save_leaves_the_previous_checkpoint_whole(runs):
    root, refs = runs
    out = root / "killed"
    tmp = list(out.glob("checkpoint.tmp-*"))
    assert len(tmp) == 1 and not (tmp[0] / "state.json").exists()  # the save in progress, never picked
    assert (tmp[0] / "weights.rank1.safetensors").is_file()  # it was killed inside the save
    assert ckpt.find(out) == out / "checkpoint" and ckpt.saved_step(out / "checkpoint") == 1
    state = ckpt.check_readable(out / "checkpoint")  # whole: every part there and readable
    assert state["parts"] == 2
    got, _ = finish_in_one_process(root, "lora", out="killed")  # resumed (in one process) to the end
    assert max_abs_diff(got, refs["lora"]) <= 1e-5
    assert_same_run(out, root / "ref-lora")
    assert not list(out.glob("checkpoint.tmp-*"))  # the next save cleared it


def test_chunk_rows_are_torch_chunk_rows():
    for n in (0, 1, 2, 5, 7, 16):
        for parts in (1, 2, 3, 4):
            got = [shards.chunk_rows(n, parts, r) for r in range(parts)]
            want = [0]
            for c in torch.arange(n).chunk(parts):
                want.append(want[-1] + len(c))
            want += [n] * (parts + 1 - len(want))
            assert got == list(itertools.pairwise(want)), (n, parts)


def test_world_note_only_at_another_world_size():
    assert ckpt.world_note({"world_size": 2}, 2) is None
    assert ckpt.world_note({}, 1) is None  # format 1: one process
    note = ckpt.world_note({"world_size": 2}, 3)
    assert note is not None and "\n" not in note and "saved by 2 processes, this run has 3" in note
