"""Experiment trackers (`report_to=`, `minitrain.trackers`) through the command, read back with each
library's own storage: wandb offline (its run files), Trackio's local store, MLflow from a real
`mlflow server` this module starts on localhost with a SQLite store, TensorBoard's event reader.

One run writes to all four at once and is stopped after 2 of 4 steps (`stop_after`), then resumed:
every tracker must hold the run's config and each metrics.jsonl row under the same names, in one
tracker run that the resume continued (its id kept in the checkpoint). A tracker that cannot reach
its server is one warning, and the run still ends well.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from minitrain.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demo"
KEYS = ("loss", "lr", "grad_norm", "tokens", "eval/loss")

for package in ("wandb", "trackio", "mlflow", "tensorboard"):
    pytest.importorskip(package)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on localhost over a SQLite store; its URI."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                               "--default-artifact-root", str(root / "artifacts"), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("mlflow server did not start")
            time.sleep(0.5)
    yield uri
    server.terminate()
    server.wait(30)


def sft(*extra: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minitrain", str(ROOT / "recipes" / "sft_llama.py"),
                           f"model={DEMO / 'model'}", f"data={DEMO / 'sft_train.jsonl'}", "max_len=64", "batch_size=2",
                           "grad_accum=1", *extra], cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, mlflow_server):
    """An SFT run reporting to all four trackers, stopped after 2 of 4 steps and resumed."""
    cwd = tmp_path_factory.mktemp("tracked")
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "mt", "TRACKIO_DIR": str(cwd / "trackio"),
           "TRACKIO_PROJECT": "mt", "MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_EXPERIMENT_NAME": "mt"}
    common = ("max_steps=4", "out=run", "report_to=tensorboard,wandb,trackio,mlflow", "eval_every=2",
              f"eval_data={DEMO / 'sft_train.jsonl'}")
    first = sft(*common, "stop_after=2", cwd=cwd, env=env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    ids = json.loads((cwd / "run" / "checkpoint" / "state.json").read_text())["trackers"]
    second = sft(*common, "resume=true", cwd=cwd, env=env)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "warning:" not in first.stdout + second.stdout
    rows = [json.loads(line) for line in (cwd / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    config = json.loads((cwd / "run" / "config.json").read_text())
    return cwd, rows, ids, config, env


def expected(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if key in r]


def wandb_rows(path: Path) -> list:
    """The records of a `.wandb` file (wandb's LevelDB-style log of protobuf `Record`s, 32 KiB blocks,
    a 7-byte file header), parsed here because wandb no longer ships a reader."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, records, chunk = path.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            records.append(pb.Record.FromString(chunk))
            chunk = b""
    return records


def test_wandb_offline_holds_the_config_and_every_row_in_one_resumed_run(resumed_run):
    cwd, rows, ids, config, _ = resumed_run
    files = sorted((cwd / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{ids['wandb']}.wandb" for f in files)  # one run id, two launches
    history: dict[int, dict] = {}
    logged_config = {}
    for f in files:
        for r in wandb_rows(f):
            if r.HasField("history"):
                item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                history.setdefault(item["_step"], {}).update(item)
            if r.HasField("run"):  # the run record carries the config given to init
                logged_config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
    for key in KEYS:
        assert [(s, history[s][key]) for s in sorted(history) if key in history[s]] == \
            pytest.approx(expected(rows, key), rel=1e-9), key
    assert logged_config["lr"] == config["lr"] and logged_config["report_to"] == config["report_to"]


def test_trackio_local_store_holds_every_row_of_the_resumed_run(resumed_run):
    cwd, rows, ids, config, env = resumed_run
    probe = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage\n"
             "print(json.dumps(SQLiteStorage.get_logs(sys.argv[1], sys.argv[2])))\n"
             "print(json.dumps(SQLiteStorage.get_run_config(sys.argv[1], sys.argv[2])))\n")
    r = subprocess.run([sys.executable, "-c", probe, "mt", ids["trackio"]], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    logs, logged_config = (json.loads(line) for line in r.stdout.strip().splitlines()[-2:])
    assert ids["trackio"] == "run"  # named after the out folder; the resume continued it
    for key in KEYS:
        got = [(x["step"], x[key]) for x in logs if key in x]
        assert got == pytest.approx(expected(rows, key), rel=1e-9), key
    assert logged_config["lr"] == config["lr"]


def test_mlflow_server_holds_params_and_every_row_of_the_resumed_run(resumed_run):
    from mlflow import MlflowClient

    _, rows, ids, config, env = resumed_run
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    run = client.get_run(ids["mlflow"])
    assert run.data.params["lr"] == str(config["lr"]) and run.info.status == "FINISHED"
    assert len(client.search_runs([client.get_experiment_by_name("mt").experiment_id])) == 1
    for key in KEYS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == pytest.approx(expected(rows, key), rel=1e-9), key


def test_tensorboard_event_files_read_back_equal_to_metrics_jsonl(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cwd, rows, *_ = resumed_run
    acc = EventAccumulator(str(cwd / "run" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for key in KEYS:
        events, want = acc.Scalars(key), expected(rows, key)
        assert [e.step for e in events] == [step for step, _ in want], key
        assert [e.value for e in events] == pytest.approx([v for _, v in want], rel=1e-6), key  # float32


def test_a_tracker_that_cannot_reach_its_server_is_one_warning_and_the_run_ends_well(tmp_path):
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    p = sft("max_steps=2", "out=run", "report_to=mlflow", cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    warnings = [line for line in p.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: report_to=mlflow: could not start"), p.stdout
    assert "training goes on without it; metrics.jsonl keeps every row" in warnings[0]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("given, says", [
    ("wandb", "report_to=wandb: the wandb package is not installed — pip install"),
    ("tensorbord", "'tensorbord' is not a tracker — use any of tensorboard, wandb, trackio, mlflow"),
])
def test_a_missing_package_or_an_unknown_tracker_is_one_line(monkeypatch, given, says):
    import importlib.util

    from minitrain.cli import apply_overrides
    from minitrain.config import TrainConfig, validate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError) as e:
        validate(apply_overrides(TrainConfig(), [f"report_to={given}"]))
    assert says in str(e.value) and "\n" not in str(e.value)
