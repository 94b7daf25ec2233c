"""Disk full and read-only output folders: one clear line, and the previous checkpoint survives.

A write can fail anywhere: a safetensors file (safetensors raises its own `SafetensorError("...
No space left on device (os error 28)")`, not an OSError), state.json's fsync, the renames. Each
point is simulated by making that one call fail, and where the machine allows it (root with
`mount`), also for real: a small tmpfs that fills up, and a tmpfs remounted read-only.

Properties: the checkpoint from before the failing save stays complete and loads to the same
values; the error is one `UserError` naming the folder and saying "no space left on device" /
"read-only"; nothing half-written is left behind (no `checkpoint.tmp-*`, no `.tmp` adapter file).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from _tok import make_bpe_tokenizer
from safetensors import SafetensorError

from minitrain import checkpoint as ckpt, weights as weights_mod
from minitrain.adapters import peft_format
from minitrain.cli import run_cli
from minitrain.errors import UserError
from minitrain.weights import io_error_reason

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "sft_llama.py")
ENOSPC_SAFETENSORS = "Error while serializing: I/O error: No space left on device (os error 28)"

# ----------------------------------------------------------------------------- a checkpoint to damage


def params_and_optimizer(seed: int) -> tuple[list[tuple[str, torch.nn.Parameter]], torch.optim.AdamW]:
    g = torch.Generator().manual_seed(seed)
    named = [(f"layer.{i}.lora_A.weight", torch.nn.Parameter(torch.randn(4, 16, generator=g))) for i in range(3)]
    opt = torch.optim.AdamW([p for _, p in named], lr=1e-3)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return named, opt


def save_step(out: Path, step: int):
    named, opt = params_and_optimizer(step)
    ckpt.save(out, named, opt, {"step": step})
    return named


def assert_intact(out: Path, step: int, values) -> None:
    """The checkpoint `find` picks holds `step` and loads to exactly `values`; nothing half-written is picked."""
    folder = ckpt.find(out)
    assert folder is not None and json.loads((folder / "state.json").read_text())["step"] == step
    named, opt = params_and_optimizer(99)
    state = ckpt.load(out, named, opt)
    assert state["step"] == step
    for (n, p), (m, q) in zip(named, values):
        assert n == m and torch.equal(p.detach(), q.detach())
    assert len(opt.state) == len(named)


# ----------------------------------------------------------------------------- failing writes


@contextlib.contextmanager
def failing(monkeypatch, where: str):
    """Make one write of `ckpt.save` fail as a full disk makes it fail."""
    if where in ("weights", "optimizer", "rng"):
        real = ckpt.save_file

        def save_file(tensors, path, *a, **kw):
            if Path(path).name == f"{where}.safetensors":
                raise SafetensorError(ENOSPC_SAFETENSORS)
            return real(tensors, path, *a, **kw)

        monkeypatch.setattr(ckpt, "save_file", save_file)
    elif where == "state.json":  # buffered JSON: ENOSPC surfaces at flush / fsync
        def fsync(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(ckpt.os, "fsync", fsync)
    elif where == "rename":  # the new folder's rename into place fails (once)
        real_replace = os.replace
        failed = []

        def replace(a, b):
            if Path(b).name == ckpt.NAME and not failed:
                failed.append(a)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(a), None, str(b))
            return real_replace(a, b)

        monkeypatch.setattr(ckpt.os, "replace", replace)
    else:
        raise ValueError(where)
    try:
        yield
    finally:
        monkeypatch.undo()


def _can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = Path(tempfile.mkdtemp(prefix="minitrain-mount-probe-"))
    try:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                          capture_output=True).returncode != 0:
            return False
        return subprocess.run(["umount", str(probe)], capture_output=True).returncode == 0
    except OSError:
        return False
    finally:
        shutil.rmtree(probe, ignore_errors=True)


CAN_MOUNT = _can_mount()


@pytest.fixture
def small_fs(tmp_path):
    """A real tmpfs of 192 KiB at tmp_path/fs (root with mount only), unmounted afterwards."""
    if not CAN_MOUNT:
        pytest.skip("needs root and mount (tmpfs) for a real full / read-only filesystem")
    fs = tmp_path / "fs"
    fs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(fs)], check=True)
    try:
        yield fs
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


def fill(folder: Path, leave: int) -> None:
    """Fill the filesystem of `folder` until about `leave` bytes are free."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    with open(folder / "filler", "wb") as f:
        f.write(b"\0" * max(free - leave, 0))


SIMULATED = ["weights", "optimizer", "rng", "state.json", "rename"]


def failed_save(request, tmp_path, monkeypatch) -> tuple[Path, list, BaseException]:
    """Save step 1, then a step-2 save that fails (simulated at `request.param`, or a really full tmpfs)."""
    if request.param == "real-full-tmpfs":
        out = request.getfixturevalue("small_fs") / "out"
        values = save_step(out, 1)
        fill(out.parent, leave=20_000)  # a checkpoint is ~2 x 2.5 KB of tensors + JSON; optimizer does not fit
        with pytest.raises(Exception) as e:
            save_step(out, 2)
        (out.parent / "filler").unlink()
        return out, values, e.value
    out = tmp_path / "out"
    values = save_step(out, 1)
    with failing(monkeypatch, request.param), pytest.raises(Exception) as e:
        save_step(out, 2)
    return out, values, e.value


@pytest.fixture(params=SIMULATED + ["real-full-tmpfs"])
def disk_full(request, tmp_path, monkeypatch):
    return failed_save(request, tmp_path, monkeypatch)


def test_disk_full_keeps_the_previous_checkpoint(disk_full):
    out, values, _ = disk_full
    assert_intact(out, 1, values)


def test_disk_full_is_one_clear_line_and_leaves_no_tmp(disk_full):
    out, _, err = disk_full
    assert isinstance(err, UserError), f"{type(err).__name__}: {err}"
    assert "\n" not in str(err) and str(out) in str(err) and "no space left on device" in str(err), str(err)
    assert not list(out.glob(f"{ckpt.NAME}.tmp-*"))


# ----------------------------------------------------------------------------- read-only output folder


@contextlib.contextmanager
def read_only(out: Path, how: str, monkeypatch):
    """Make `out` unwritable: chmod (non-root), a read-only remount (root + mount), or, as root
    without mount, a simulation: root ignores permission bits, so chmod would not stop the write
    and the test would prove nothing — `Path.mkdir` under `out` is made to fail with EROFS instead."""
    if how == "real-ro-remount":
        subprocess.run(["mount", "-o", "remount,ro", str(out.parent)], check=True)
        try:
            yield
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(out.parent)], check=True)
        return
    out.chmod(0o555)
    probe = out / ".probe"
    try:
        probe.touch()
        probe.unlink()
        chmod_works = False  # root: writes go through despite 0o555
    except PermissionError:
        chmod_works = True
    if not chmod_works:
        real_mkdir = Path.mkdir

        def mkdir(self, *a, **kw):
            if Path(self).is_relative_to(out):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            return real_mkdir(self, *a, **kw)

        monkeypatch.setattr(Path, "mkdir", mkdir)
    try:
        yield
    finally:
        monkeypatch.undo()
        out.chmod(0o755)


@pytest.fixture(params=["chmod-or-simulated", "real-ro-remount"])
def read_only_save(request, tmp_path, monkeypatch):
    if request.param == "real-ro-remount":
        out = request.getfixturevalue("small_fs") / "out"
    else:
        out = tmp_path / "out"
    values = save_step(out, 1)
    with read_only(out, request.param, monkeypatch), pytest.raises(Exception) as e:
        save_step(out, 2)
    return out, values, e.value


def test_read_only_out_keeps_the_previous_checkpoint(read_only_save):
    out, values, _ = read_only_save
    assert_intact(out, 1, values)


def test_read_only_out_is_one_clear_line(read_only_save):
    out, _, err = read_only_save
    assert isinstance(err, UserError), f"{type(err).__name__}: {err}"
    assert "\n" not in str(err) and str(out) in str(err), str(err)
    assert "read-only" in str(err) or "permission denied" in str(err), str(err)


# ----------------------------------------------------------------------------- adapter and weights writes


def test_io_error_reason():
    assert io_error_reason(SafetensorError(ENOSPC_SAFETENSORS)) == "no space left on device"
    assert io_error_reason(OSError(errno.EROFS, "x")) == "read-only file system"
    assert io_error_reason(PermissionError(errno.EACCES, "x")) == "permission denied"


def _full_disk_save_file(tensors, path, *a, **kw):
    raise SafetensorError(ENOSPC_SAFETENSORS)


def test_save_pretrained_disk_full_is_one_line_and_keeps_the_old_folder(hf_causal, tmp_path, monkeypatch):
    import models

    folder = tmp_path / "merged"
    model = weights_mod.load_pretrained(hf_causal("disk_errors_llama"), models.from_hf_config)
    weights_mod.save_pretrained(model, folder, model.hf_config)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    monkeypatch.setattr(weights_mod, "save_file", _full_disk_save_file)
    with pytest.raises(UserError) as e:
        weights_mod.save_pretrained(model, folder, model.hf_config)
    assert str(e.value).startswith(f"{folder}: cannot write the weights: no space left on device — ")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no .merged.tmp-* left


@pytest.fixture(scope="module")
def model_dir(hf_causal, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("disk_model") / "model"
    shutil.copytree(hf_causal("disk_errors_llama"), d)
    make_bpe_tokenizer(d)
    return d


def cli_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    data = REPO / "tests" / "bad_inputs" / "data" / "good.jsonl"
    return [RECIPE, f"model={model_dir}", f"data={data}", f"out={out}", "max_steps=2", "save_every=1",
            "batch_size=2", "lora_r=4", "device=cpu", "chat_format=mistral", *extra]


def one_error_line(err: str) -> str:
    """The one `error:` line, last on stderr (in-process, stderr also holds the progress bar)."""
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err
    return errors[0]


def steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_adapter_write_fails_at_the_end_then_resume_writes_it(model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setattr(peft_format, "save_file", _full_disk_save_file)
    assert run_cli(cli_args(model_dir, out)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line == (f"error: {out / 'adapter'}: cannot write the adapter: no space left on device — the trained "
                    f"checkpoint is in {out / 'checkpoint'}: free space or make {out} writable, then rerun with "
                    f"resume=true to write the adapter")
    assert not (out / "adapter").exists() or not list((out / "adapter").iterdir())  # no half-written file
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 2

    monkeypatch.undo()  # space freed
    assert run_cli(cli_args(model_dir, out, "resume=true")) == 0, capsys.readouterr().err
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert steps_logged(out) == [1, 2]


def test_checkpoint_write_fails_mid_run_then_resume_finishes(model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    real = ckpt.save_file
    calls = {"n": 0}

    def save_file(tensors, path, *a, **kw):  # the second checkpoint (step 2) finds the disk full
        calls["n"] += 1
        if calls["n"] > 3:
            raise SafetensorError(ENOSPC_SAFETENSORS)
        return real(tensors, path, *a, **kw)

    monkeypatch.setattr(ckpt, "save_file", save_file)
    code = run_cli(cli_args(model_dir, out))
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 2, err
    line = one_error_line(err)
    assert str(out) in line and "no space left on device" in line and "resume=true" in line, line
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 1
    assert not list(out.glob("checkpoint.tmp-*"))
    assert run_cli(cli_args(model_dir, out, "resume=true")) == 0
    assert steps_logged(out) == [1, 2]
