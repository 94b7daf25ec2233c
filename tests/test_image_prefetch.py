"""Image rows' next micro-batch collated in a background thread while one trains (`minitrain/data/prefetch.py`,
the loop in `minitrain/train.py`), on tests/test_image_rows.py's tiny Qwen2.5-VL folder and rows.

Checked: SFT from the command line logs the same losses, gradient norms and token counts, bit for bit, whether
the worker made the batches or the loop collated each itself, and the worker made every batch but the run's
first (`data_wait` logged each step); a run cut after step 1 (`stop_after=1`) and resumed equals the
uninterrupted one, and so does one stopped by SIGINT; an image gone once training started is one line naming
the file and the data row, exit 2, at the step that uses it (the steps before it logged); a batch made ahead
and never used is dropped silently; no worker thread is left running; under torchrun the run equals one
process's (each rank prefetches its own share).
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_image_rows import rows_of, vl_folder, write_rows

import minitrain.train
from minitrain.cli import run_cli
from minitrain.data.batcher import Batcher
from minitrain.data.prefetch import Prefetch
from minitrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SAME = ("step", "loss", "grad_norm", "lr", "tokens", "target_tokens")  # what must be equal, bit for bit


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image_prefetch")
    return {"root": root, "model": vl_folder(root / "model"), "data": write_rows(root / "data")}


def sft(vlm, out: Path, *extra: str, data: Path | None = None) -> int:
    return run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={data or vlm['data']}",
                    f"out={out}", "batch_size=1", "grad_accum=2", "max_steps=3", "lora_r=4", "lora_alpha=8",
                    "device=cpu", "max_len=256", "log_every=1",
                    "threads=1", *extra])  # one thread: the runs compared bit for bit sum in one order


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def workers_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("minitrain-prefetch")]


class Counted(Prefetch):
    """Counts the batches taken from the worker and those the loop collated itself."""
    taken: list[str] = []

    def get(self, indices):
        made = self.made is not None and self.made[0] == tuple(indices)
        Counted.taken.append("worker" if made else "loop")
        return super().get(indices)


class InTheLoop(Counted):
    """No batch made ahead: the loop collates each itself (the path of text rows)."""

    def ahead(self, indices):
        pass


def test_prefetched_batches_log_the_losses_of_batches_collated_in_the_loop(vlm, tmp_path, capsys, monkeypatch):
    runs = {}
    for kind in (Counted, InTheLoop):
        monkeypatch.setattr(minitrain.train, "Prefetch", kind)
        Counted.taken = []
        code = sft(vlm, tmp_path / kind.__name__)
        assert code == 0, capsys.readouterr().err
        assert not workers_alive()
        runs[kind] = (rows(tmp_path / kind.__name__), Counted.taken)
    (ahead, taken), (loop, loop_taken) = runs[Counted], runs[InTheLoop]
    assert taken == ["loop"] + ["worker"] * 5 and loop_taken == ["loop"] * 6  # 3 steps x 2 micro-batches
    assert [{k: r[k] for k in SAME} for r in ahead] == [{k: r[k] for k in SAME} for r in loop]
    assert [r["step"] for r in ahead] == [1, 2, 3] and all(0 <= r["data_wait"] < 1 for r in ahead + loop)


def test_a_run_cut_after_step_1_and_resumed_equals_the_uninterrupted_run(vlm, tmp_path, capsys):
    assert sft(vlm, tmp_path / "whole") == 0
    assert sft(vlm, tmp_path / "cut", "stop_after=1") == 0  # the next step's first batch made ahead, dropped
    assert [r["step"] for r in rows(tmp_path / "cut")] == [1] and not workers_alive()
    assert sft(vlm, tmp_path / "cut", "resume=true") == 0, capsys.readouterr().err
    assert not workers_alive()
    want, got = rows(tmp_path / "whole"), rows(tmp_path / "cut")
    assert [{k: r[k] for k in SAME} for r in got] == [{k: r[k] for k in SAME} for r in want]
    a, b = (load_file(tmp_path / run / "adapter" / "adapter_model.safetensors") for run in ("whole", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigint_mid_step_leaves_no_worker_and_the_resume_equals_the_run(vlm, tmp_path, capsys, monkeypatch):
    """SIGINT while step 2's first micro-batch trains (its second made ahead): the step finishes, the checkpoint is
    saved, exit 130 with no worker left; the next step's first batch, made ahead, is dropped; resumed, the run
    logs the uninterrupted run's losses."""
    import os
    import signal

    class Signals(Counted):
        def get(self, indices):
            if len(Counted.taken) == 2:  # step 2's first micro-batch
                os.kill(os.getpid(), signal.SIGINT)
            return super().get(indices)

    assert sft(vlm, tmp_path / "whole") == 0
    monkeypatch.setattr(minitrain.train, "Prefetch", Signals)
    Counted.taken = []
    assert sft(vlm, tmp_path / "cut") == 130, capsys.readouterr().err
    assert not workers_alive() and [r["step"] for r in rows(tmp_path / "cut")] == [1, 2]
    monkeypatch.setattr(minitrain.train, "Prefetch", Prefetch)
    assert sft(vlm, tmp_path / "cut", "resume=true") == 0, capsys.readouterr().err
    want, got = rows(tmp_path / "whole"), rows(tmp_path / "cut")
    assert [{k: r[k] for k in SAME} for r in got] == [{k: r[k] for k in SAME} for r in want]


def test_an_image_gone_during_training_is_one_line_at_the_step_that_uses_it(vlm, tmp_path, capsys, monkeypatch):
    """c.png (data row 3, example 2) removed when the loop starts: the steps before the one using it train and log;
    the worker met the error while the step before trained, and it is raised when the loop takes that batch."""
    data = tmp_path / "data"
    shutil.copytree(vlm["data"].parent, data)
    gone = data / "img" / "c.png"

    class Unlinks(Counted):
        def __init__(self, *args):
            super().__init__(*args)
            gone.unlink()

    # a seed whose order puts example 2 in step 2 (batch_size 1 x grad_accum 2: micro-batch 2 or 3 of epoch 0)
    lengths = minitrain.train._lengths(rows_of(vlm)[0])
    seed = next(s for s in range(50) if Batcher(lengths, 1, seed=s).epoch_batches(0).index([2]) >= 2)
    monkeypatch.setattr(minitrain.train, "Prefetch", Unlinks)
    Counted.taken = []
    capsys.readouterr()
    code = sft(vlm, tmp_path / "out", f"seed={seed}", data=data / "rows.jsonl")
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"{data / 'rows.jsonl'}:3: image {gone} does not exist" in lines[0], lines
    assert not workers_alive()
    assert [r["step"] for r in rows(tmp_path / "out")] == [1]  # step 2 took the batch
    assert Counted.taken[-1] == "worker"  # the error came from the worker's batch


def test_a_batch_made_ahead_and_never_used_is_dropped_silently():
    def collate(examples):
        if examples == ["bad"]:
            raise UserError("rows.jsonl:2: image gone.png does not exist")
        return {"n": len(examples)}

    p = Prefetch(collate, ["good", "bad"])
    p.ahead([1])
    assert p.get([0]) == {"n": 1}  # not the one made ahead: collated now; the other's error never raised
    p.ahead([1])
    with pytest.raises(UserError, match="^rows.jsonl:2: image gone.png does not exist$"):
        p.get([1])
    p.ahead([1])
    p.close()
    assert p.wait > 0 and not workers_alive()


@pytest.mark.slow
def test_torchrun_ranks_prefetch_their_share(vlm, tmp_path):
    """2 ddp ranks (batch_size 2: one example each per micro-batch), each prefetching its share: the same ranks'
    collectives, and the losses of one process to 1e-5 (the ranks sum in another order); cut after step 1 and
    resumed with resume=true at 2 ranks (the batch order peeked ahead never saved), it ends as the uninterrupted
    2-rank run: the same steps' losses and adapter."""
    from test_torchrun_resume import assert_equal_runs, launch

    args = [str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={vlm['data']}", "batch_size=2",
            "grad_accum=2", "max_steps=2", "lora_r=4", "lora_alpha=8", "device=cpu", "max_len=256", "log_every=1"]
    launch(1, [*args, f"out={tmp_path / 'one'}"])
    launch(2, [*args, f"out={tmp_path / 'two'}"])
    one, two = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2] and all("data_wait" in r for r in two)
    for a, b in zip(one, two):
        assert a["tokens"] == b["tokens"] and abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
    cut = [*args, f"out={tmp_path / 'cut'}", "save_every=1"]
    launch(2, [*cut, "stop_after=1"])
    assert [r["step"] for r in rows(tmp_path / "cut")] == [1]
    launch(2, [*cut, "resume=true"])
    assert [r["step"] for r in rows(tmp_path / "cut")] == [1, 2]
    assert_equal_runs(tmp_path / "cut", tmp_path / "two", tol=0.0)
