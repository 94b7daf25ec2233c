"""The folders a checkpoint save leaves behind when killed, and what `find` / the next save make of them.

A save writes `checkpoint.tmp-<pid>`, moves `checkpoint/` to `checkpoint.old-<pid>` and renames the
new one in. A kill can leave a half-written tmp-*, or (between the renames) no `checkpoint/` and a
complete old-*; several kills leave several, and pids say nothing about which is newest.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError

from minitrain import checkpoint as ckpt
from minitrain.errors import UserError
from minitrain.run import check_out_dir
from test_disk_errors import params_and_optimizer, save_step


def killed_between_renames(out: Path, step: int, pid: int) -> None:
    """A complete checkpoint at `step` left as `checkpoint.old-<pid>`, as a kill between the renames
    leaves it (saved elsewhere: a save in `out` would clear the leftovers already there)."""
    scratch = out.with_name(f"{out.name}-scratch")
    save_step(scratch, step)
    out.mkdir(parents=True, exist_ok=True)
    os.replace(scratch / ckpt.NAME, out / f"{ckpt.NAME}.old-{pid}")


def loads_as(out: Path, step: int, values) -> None:
    named, opt = params_and_optimizer(99)
    assert ckpt.load(out, named, opt)["step"] == step
    for (n, p), (m, q) in zip(named, values):
        assert n == m and torch.equal(p.detach(), q.detach())


@pytest.fixture
def leftovers(tmp_path) -> Path:
    """Three kills between the renames at steps 1, 2, 3, whose pids sort (as strings and as numbers)
    in another order, an old-* whose state.json does not read, a half-written tmp-* and a tmp-* killed
    before its rename (never renamed in: not picked, even with a state.json and a higher step)."""
    out = tmp_path / "out"
    for step, pid in [(1, 10), (2, 100), (3, 9)]:
        killed_between_renames(out, step, pid)
    shutil.copytree(out / f"{ckpt.NAME}.old-9", out / f"{ckpt.NAME}.old-7")
    (out / f"{ckpt.NAME}.old-7" / "state.json").write_text('{"step": 5')  # cut short: skipped
    for pid in (8, 11):
        (out / f"{ckpt.NAME}.tmp-{pid}").mkdir()
        (out / f"{ckpt.NAME}.tmp-{pid}" / "weights.safetensors").write_bytes(b"half")
    (out / f"{ckpt.NAME}.tmp-11" / "state.json").write_text('{"step": 6}')
    return out


def test_find_picks_the_old_folder_with_the_highest_step(leftovers):
    assert ckpt.find(leftovers) == leftovers / f"{ckpt.NAME}.old-9"
    assert ckpt.read_state(leftovers)["step"] == 3
    assert ckpt.fallback_note(leftovers) == (f"checkpoint: resuming from {ckpt.NAME}.old-9 (step 3) — the last "
                                             f"save was interrupted")


def test_find_prefers_a_complete_checkpoint_and_never_picks_a_tmp(tmp_path, leftovers):
    save_step(leftovers, 1)  # a complete checkpoint/ wins even over a higher step in an old-*
    assert ckpt.find(leftovers) == leftovers / ckpt.NAME and ckpt.fallback_note(leftovers) is None
    out = tmp_path / "only_tmp"
    (out / f"{ckpt.NAME}.tmp-5").mkdir(parents=True)
    (out / f"{ckpt.NAME}.tmp-5" / "weights.safetensors").write_bytes(b"half")
    assert ckpt.find(out) is None
    with pytest.raises(UserError, match="no checkpoint to resume from"):
        ckpt.read_state(out)


def test_a_save_removes_the_leftovers_and_the_new_checkpoint_loads(leftovers):
    (leftovers / f"{ckpt.NAME}.old-notes").mkdir()  # not a writer's (no pid): not ours to remove
    values = save_step(leftovers, 4)
    assert sorted(p.name for p in leftovers.iterdir()) == [ckpt.NAME, f"{ckpt.NAME}.old-notes"]
    assert ckpt.find(leftovers) == leftovers / ckpt.NAME
    loads_as(leftovers, 4, values)


def test_a_stale_old_folder_with_our_pid_does_not_stop_a_save(tmp_path):
    """Pids repeat (containers start the trainer with the same pid): a run killed while deleting its
    old-<pid> after the swap, and a new run with that pid."""
    out = tmp_path / "out"
    save_step(out, 2)
    killed_between_renames(out, 1, os.getpid())
    values = save_step(out, 3)  # moves checkpoint/ aside onto a name that is taken
    assert sorted(p.name for p in out.iterdir()) == [ckpt.NAME]
    loads_as(out, 3, values)


def test_a_failed_save_keeps_the_old_folder_that_find_needs(tmp_path, monkeypatch):
    out = tmp_path / "out"
    killed_between_renames(out, 2, 12345)
    values = params_and_optimizer(2)[0]

    def full(*a, **kw):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt, "save_file", full)
    with pytest.raises(UserError, match="no space left on device .* continue from the last complete checkpoint "
                                        r"\(step 2\)"):
        save_step(out, 3)
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == [f"{ckpt.NAME}.old-12345"]
    loads_as(out, 2, values)


def test_resume_logs_the_fallback_once(leftovers, capsys):
    cfg = SimpleNamespace(out=str(leftovers), resume=True, overwrite=False)
    assert check_out_dir(cfg) == leftovers
    assert capsys.readouterr().out.splitlines() == [ckpt.fallback_note(leftovers)]
    (leftovers / f"{ckpt.NAME}.old-9" / "state.json").unlink()  # no longer complete: the next best
    check_out_dir(cfg)
    assert "checkpoint.old-100 (step 2)" in capsys.readouterr().out
    save_step(leftovers, 4)
    check_out_dir(cfg)
    assert capsys.readouterr().out == ""


def test_a_damaged_state_json_is_one_line_not_a_traceback(tmp_path):
    out = tmp_path / "out"
    save_step(out, 2)
    (out / ckpt.NAME / "state.json").write_text('{"step": 2, "run"')  # damaged by hand, not by a save
    with pytest.raises(UserError) as e:
        ckpt.read_state(out)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{out / ckpt.NAME / 'state.json'}: unreadable (")
    assert "without resume=true" in msg
