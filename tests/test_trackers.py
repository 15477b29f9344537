"""Experiment trackers (``metrics.wandb``, ``metrics.mlflow``): what each one receives, read back with
the tracker's own tools.

- W&B runs offline: the run's transaction log (``<run_dir>/wandb/offline-run-*/run-ID.wandb``) is read
  record by record -- its framing is LevelDB's log format
  (https://github.com/google/leveldb/blob/main/doc/log_format.md) behind a 7-byte ``:W&B`` header, each
  record a ``wandb.proto.wandb_internal_pb2.Record`` -- and ``wandb sync --dry-run`` must list it.
- MLflow runs against a real ``mlflow server`` this module starts once, bound to 127.0.0.1 on a free
  port, with its store in a temporary folder; it is stopped (its whole process group) when the module
  ends. Metrics and the config are read back through ``MlflowClient``.

Both check that a resumed run continues the same tracker run (one curve). For each tracker, W&B,
MLflow and TensorBoard, a secret on the command line (``sys.argv``, which W&B records) and in the config
must appear in none of the tracker's own files. Each test skips, saying so, where its package is not
installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from portatrain.metrics import TRACKERS_FILE, MetricsLogger, metrics_problems, mlflow_uri_problem
from portatrain.metrics.trackers import _MLFLOW_HTTP_DEFAULTS, _Tracker
from tests.helpers import ROOT, TINY, compose_config, fit, launch_env, python, run_cli, train_records

needs_wandb = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None,
    reason="wandb is not installed (pip install 'portatrain[wandb]')",
)
needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None,
    reason="mlflow is not installed (pip install 'portatrain[mlflow]')",
)

SECRET = ["+parallel.launch.env.WANDB_API_KEY=topsecret-value"]  # redacted by its key's name
RESUME = ["trainer.steps=6", "checkpoint.resume=auto"]


def _on_the_command_line(monkeypatch: pytest.MonkeyPatch, overrides: list[str]) -> None:
    """``sys.argv`` as ``portatrain OVERRIDES...`` leaves it: a tracker that records the command line
    (W&B does) sees the secret there as well as in the config."""
    monkeypatch.setattr(sys, "argv", ["portatrain", *overrides])


def _files_holding(root: Path, secret: bytes) -> list[Path]:
    """The files under ``root`` whose bytes hold ``secret``."""
    return [p for p in root.rglob("*") if p.is_file() and secret in p.read_bytes()]


def _tracker_ids(run_dir: Path) -> dict:
    return json.loads((run_dir / TRACKERS_FILE).read_text())


# -- W&B, offline ------------------------------------------------------------------------------------
def _wandb_records(path: Path) -> Iterator:
    """The protobuf records of a W&B transaction log (LevelDB log framing: 32 KiB blocks of
    ``crc32 | length (2 bytes, little-endian) | type`` chunks; type 1 is a whole record, 2-4 first,
    middle and last pieces of one)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B", path
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def _ends_with_exit(path: Path) -> bool:
    try:
        return [r.WhichOneof("record_type") for r in _wandb_records(path)][-1:] == ["exit"]
    except Exception:  # a record half written
        return False


def _wandb_run(path: Path) -> tuple[str, dict[str, str], dict[int, dict[str, float]]]:
    """A transaction log's run id, config (key -> JSON) and history (step -> name -> value).

    ``run.finish()`` can return before W&B's service has written the log (seen: a resumed run's log
    still its 7-byte header), so the log is read once it ends with its ``exit`` record (30 s at most)."""
    deadline = time.monotonic() + 30
    while not _ends_with_exit(path):
        assert time.monotonic() < deadline, f"{path} has no exit record after 30 s"
        time.sleep(0.2)
    run_id, config, history = "", {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({item.key: item.value_json for item in record.run.config.update})
        elif kind == "history":
            # A name with "/" arrives split into its parts (nested_key).
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.setdefault(record.history.step.num, {}).update(row)
    return run_id, config, history


@needs_wandb
def test_wandb_offline_run_continues_after_resume_with_config_redacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    _on_the_command_line(monkeypatch, ["metrics.wandb=true", *SECRET])
    fit(["metrics.wandb=true", *SECRET], tmp_path)
    run_id = _tracker_ids(tmp_path)["wandb"]["run_id"]
    fit(["metrics.wandb=true", *SECRET, *RESUME], tmp_path)
    assert _tracker_ids(tmp_path)["wandb"]["run_id"] == run_id

    # Two offline directories, one per process, both of the same run: `wandb sync` joins them.
    logs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(logs) == 2, sorted(p.name for p in (tmp_path / "wandb").iterdir())
    (first_id, config, first), (second_id, _, second) = (_wandb_run(p) for p in logs)
    assert first_id == second_id == run_id
    assert sorted(s for s, row in first.items() if "train/loss" in row) == [1, 2, 3, 4]
    assert sorted(s for s, row in second.items() if "train/loss" in row) == [5, 6]
    logged = {s: row["train/loss"] for s, row in {**first, **second}.items() if "train/loss" in row}
    assert logged == {r["step"]: pytest.approx(r["loss"]) for r in train_records(tmp_path)}
    assert {"train/lr", "train/tokens_per_s", "memory/memory_peak_bytes"} <= set(first[4])

    assert json.loads(config["launch"])["env"]["WANDB_API_KEY"] == "***"
    assert json.loads(config["trainer"])["steps"] == 4 and json.loads(config["recipe"]) == "debug"
    assert _files_holding(tmp_path / "wandb", b"topsecret") == []
    # The command line is recorded, with the secret's value hidden.
    assert all(b"WANDB_API_KEY=***" in p.read_bytes() for p in logs)

    out = subprocess.run(
        python("-m", "wandb", "sync", "--dry-run", *map(str, (p.parent for p in logs))),
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert all(str(p.parent) in out.stdout + out.stderr for p in logs), out.stdout + out.stderr


# -- MLflow, a real server ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``mlflow server`` on 127.0.0.1 (a SQLite store in a temporary folder), started once for the
    module, within 180 s, and stopped with its whole process group; yields its URI and the folder
    that holds its store and artifacts."""
    try:  # the full package: mlflow-skinny (the client) lacks the server's dependencies
        importlib.metadata.version("mlflow")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("`mlflow server` needs the full mlflow package (pip install mlflow), not mlflow-skinny")
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    log = (root / "server.log").open("w")
    # A new interpreter: mlflow's server imports no torch (a fork would save little), and it is
    # stopped by its process group, which a fork's client is not part of (tests/fork_server.py).
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(root / "artifacts")]
    # No background job runner (its workers are for GenAI jobs): a lighter server, faster to start.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield uri, root
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=20)
        log.close()


def _restore_mlflow_http_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLflow sink sets retry/timeout defaults in the environment; undo them after the test."""
    for var in _MLFLOW_HTTP_DEFAULTS:
        monkeypatch.delenv(var, raising=False)


@needs_mlflow
def test_mlflow_server_receives_metrics_and_redacted_config_and_a_resume_continues_the_run(
    mlflow_server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    _restore_mlflow_http_settings(monkeypatch)
    mlflow_server, store = mlflow_server
    _on_the_command_line(monkeypatch, [f"metrics.mlflow={mlflow_server}", *SECRET])
    fit([f"metrics.mlflow={mlflow_server}", *SECRET], tmp_path)
    ids = _tracker_ids(tmp_path)["mlflow"]
    assert ids["uri"] == mlflow_server
    fit([f"metrics.mlflow={mlflow_server}", *SECRET, *RESUME], tmp_path)
    assert _tracker_ids(tmp_path)["mlflow"] == ids

    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(ids["run_id"])
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "portatrain"
    history = client.get_metric_history(ids["run_id"], "train/loss")
    assert {m.step: m.value for m in history} == {
        r["step"]: pytest.approx(r["loss"]) for r in train_records(tmp_path)
    }
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]  # one curve across the resume
    assert {"train/lr", "train/grad_norm", "memory/memory_peak_bytes"} <= set(run.data.metrics)

    params = run.data.params
    assert params["launch.env.WANDB_API_KEY"] == "***"
    assert params["recipe"] == "debug" and params["data.seq_len"] == "64"
    assert params["trainer.steps"] == "4"  # MLflow keeps a param's first value; the resume added none
    assert not [k for k, v in params.items() if "topsecret" in v]
    assert _files_holding(store, b"topsecret") == []  # the server's own store: params, tags, metrics


# -- TensorBoard ------------------------------------------------------------------------------------------
def test_tensorboard_files_hold_scalars_and_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = ["trainer.steps=1", "metrics.tensorboard=true", *SECRET]
    _on_the_command_line(monkeypatch, overrides)
    fit(overrides, tmp_path)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and b"train/loss" in events[0].read_bytes()
    assert _files_holding(tmp_path / "tensorboard", b"topsecret") == []


@needs_mlflow
def test_unreachable_tracker_is_one_warning_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _restore_mlflow_http_settings(monkeypatch)
    uri = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        fit([f"metrics.mlflow={uri}"], tmp_path)
    assert time.perf_counter() - start < 60  # not MLflow's ~4 minutes of retries
    assert [r["step"] for r in train_records(tmp_path)] == [1, 2, 3, 4]
    warnings = [r for r in caplog.records if r.name.split(".")[0] in ("portatrain", "mlflow", "urllib3")]
    assert [r.name for r in warnings] == ["portatrain.metrics.trackers"], [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert message.startswith(f"MLflow at {uri} could not start (ConnectionRefusedError: "), message
    assert message.endswith("training goes on without it")
    assert "mlflow" not in _tracker_ids(tmp_path)


def test_a_tracker_failing_mid_run_is_dropped_after_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    class Flaky:
        def __init__(self) -> None:
            self.logged: list[int] = []

        def log(self, record: dict) -> None:
            if record["step"] == 2:
                raise ConnectionError("server went away\nsecond line token=abc123secret")
            self.logged.append(record["step"])

        def close(self) -> None:
            raise AssertionError("a dropped tracker is not closed")

    flaky = Flaky()
    tracker = _Tracker("Flaky", lambda: flaky)
    with caplog.at_level(logging.WARNING, logger="portatrain.metrics"):
        for step in (1, 2, 3):
            tracker.log({"step": step, "loss": 1.0})
        tracker.close()
    assert flaky.logged == [1]
    assert [r.getMessage() for r in caplog.records] == [
        "Flaky failed at step 2 (ConnectionError: server went away); training goes on without it"
    ]


# -- settings -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "uri",
    [
        "http://127.0.0.1:5000",
        "https://user:pw@mlflow.example.com/tracking",
        "sqlite:///mlflow.db",
        "postgresql+psycopg2://user@db.example.com/mlflow",
        "databricks",
    ],
)
def test_tracking_uris_mlflow_takes(uri: str) -> None:
    assert mlflow_uri_problem(uri) is None


@pytest.mark.parametrize(
    "uri", ["localhost:5000", "127.0.0.1:5000", "http://", "http://host:99999", "mlruns", "my server", ""]
)
def test_a_tracking_uri_that_is_not_a_uri_is_named_with_its_fix(uri: str) -> None:
    problem = mlflow_uri_problem(uri)
    assert problem is not None and problem.startswith(f"metrics.mlflow={uri!r} is not a tracking URI")
    assert "http://HOST:PORT" in problem and "sqlite:///ABS/mlflow.db" in problem


def test_mlflow_file_store_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow 3.17 refuses its file store (maintenance mode) at every client: the run logged nothing
    past one warning. Refused up front, unless MLFLOW_ALLOW_FILE_STORE opts back in."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    problem = mlflow_uri_problem("file:///tmp/mlruns") or ""
    assert problem.startswith("metrics.mlflow='file:///tmp/mlruns': MLflow's file store is in maintenance")
    assert "metrics.mlflow=sqlite:///ABS/mlflow.db" in problem and "MLFLOW_ALLOW_FILE_STORE=true" in problem
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert mlflow_uri_problem("file:///tmp/mlruns") is None


def test_a_bad_uri_never_prints_its_password() -> None:
    problem = mlflow_uri_problem("http://user:hunter2@host:notaport")
    assert problem is not None and "hunter2" not in problem


def test_a_missing_tracker_package_is_a_config_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    cfg = compose_config(TINY + ["metrics.wandb=true"])
    assert metrics_problems(cfg.metrics) == [
        "metrics.wandb needs the wandb package; pip install 'portatrain[wandb]' or set metrics.wandb=false"
    ]


def test_cli_refuses_a_tracker_uri_that_is_not_a_uri(tmp_path: Path) -> None:
    out = run_cli(
        [*TINY, f"run_dir={tmp_path / 'run'}", "metrics.mlflow=localhost:5000"], cwd=ROOT, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert "metrics.mlflow='localhost:5000' is not a tracking URI" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before anything ran


def test_only_rank_zero_starts_trackers_and_import_portatrain_imports_none(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, enabled=False, wandb=True, mlflow="http://127.0.0.1:1")
    assert logger.sinks == [] and list(tmp_path.iterdir()) == []
    code = (
        "import sys, portatrain, portatrain.trainer, portatrain.metrics, portatrain.cli\n"
        "print('LOADED', [m for m in ('wandb', 'mlflow') if m in sys.modules])\n"
    )
    # A new interpreter, not a fork of the fork server: what importing portatrain loads is the point.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout
