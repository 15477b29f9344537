"""One error path for every command: file-system errors and user mistakes are one line and exit 2,
and nothing partial is left behind.

Commands run in this process through ``portatrain.cli.main(argv=...)`` (real Hydra, tiny configs).
As root, ``chmod`` does not make a directory read-only, so the file-system errors are made two ways:
for real where a path can be wrong by itself (a file where a directory belongs), and by making the
operating system's call raise ``EROFS``/``ENOSPC`` (monkeypatched) where only a mount could.
"""

from __future__ import annotations

import errno
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from portatrain.cli import main
from portatrain.commands import COMMANDS, load_command, uses_hydra
from portatrain.errors import UserError
from portatrain.trainer import Trainer
from tests.helpers import TINY, fit

FS_ERRORS = {errno.EROFS: "Read-only file system", errno.ENOSPC: "No space left on device"}


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``portatrain ARGV`` in this process: (exit status, stderr); stdout is left in ``capsys``.
    Hydra points the root logger at the captured stdout: its handlers are restored afterwards."""
    capsys.readouterr()
    root = logging.getLogger()
    handlers, level, saved_argv = list(root.handlers), root.level, sys.argv
    sys.argv = ["portatrain"]
    try:
        main(argv=list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        root.handlers[:], root.level, sys.argv = handlers, level, saved_argv
    captured = capsys.readouterr()
    print(captured.out, end="")  # back into capsys for the test to read
    return code, captured.err


def one_line_error(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith(f"portatrain {command}: error: "), err
    return lines[0]


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)  # the default run directory (runs/...) lands here, checked empty
    monkeypatch.setattr(sys, "argv", ["portatrain"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Hydra points the root logger at this test's captured stdout: restore it for the next test.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:], root.level = handlers, level


def nothing_left(tmp_path: Path, *keep: str) -> None:
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.name not in keep)
    assert left == [], left


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    fit(["trainer.steps=1"], run_dir)
    (step,) = (run_dir / "checkpoints").glob("step_*")
    return step


# -- every command, the same path --------------------------------------------------------------------
def _argv(command: str) -> list[str]:
    if uses_hydra(load_command(command)):
        return [command, *TINY]
    return [command, "list"] if command == "kernels" else [command, "x.py"]


@pytest.mark.parametrize("code", sorted(FS_ERRORS))
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_reports_a_file_system_error_in_one_line(
    command: str,
    code: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = load_command(command)
    target = tmp_path / "out" / "file.bin"

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(code, FS_ERRORS[code], str(target))

    monkeypatch.setattr(module, "run" if uses_hydra(module) else "main", fail)
    status, err = run(_argv(command), capsys)
    line = one_line_error(err, command)
    assert status == 2 and str(target) in line and FS_ERRORS[code] in line, err
    assert errno.errorcode[code] in line and ";" in line  # the fix follows
    nothing_left(tmp_path)  # the run directory Hydra made for the command is gone again


def test_a_bug_keeps_its_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def bug(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")  # not the user's to fix: a traceback

    monkeypatch.setattr(load_command("render"), "run", bug)
    status, err = run(["render", *TINY], capsys)
    assert status == 1 and "Traceback" in err and "OSError: [Errno 5] Input/output error" in err


@pytest.mark.parametrize("output", ["no/such/dir/out.sarif", "file/out.sarif"])  # missing parent; a file
def test_argument_command_output_path_errors_are_one_line(
    output: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("mine")
    (tmp_path / "x.py").write_text("import torch\nx = torch.ones(2)\n")
    status, err = run(["audit", "x.py", "--no-config", "--format", "sarif", "-o", output], capsys)
    assert status == 2 and output.rsplit("/", 1)[0] in one_line_error(err, "audit")
    nothing_left(tmp_path, "file", "x.py")


# -- run directories (every config command) -------------------------------------------------------
@pytest.mark.parametrize("command", ["train", "bench", "parity", "report", "submit", "render"])
def test_run_dir_under_a_file_is_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("mine")
    status, err = run([command, *TINY, f"run_dir={tmp_path / 'file' / 'run'}"], capsys)
    line = one_line_error(err, command)
    assert status == 2 and "Not a directory" in line and str(tmp_path / "file" / "run") in line
    assert (tmp_path / "file").read_text() == "mine"
    nothing_left(tmp_path, "file")


def test_run_dir_on_a_read_only_file_system_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_mkdir = Path.mkdir

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        if "ro" in self.parts:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    status, err = run([*TINY, f"run_dir={tmp_path / 'ro' / 'run'}"], capsys)
    assert status == 2 and "Read-only file system" in one_line_error(err, "train")
    nothing_left(tmp_path)


# -- prepare ------------------------------------------------------------------------------------------
PREPARE = ["prepare", "data.num_documents=40", "prepare.workers=1", "trainer.progress=false"]


def test_prepare_into_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("mine")
    status, err = run([*PREPARE, "out=file"], capsys)
    assert status == 2 and "is an existing file" in one_line_error(err, "prepare")
    status, err = run([*PREPARE, "out=file/corpus"], capsys)
    assert status == 2 and "Not a directory" in one_line_error(err, "prepare")
    assert (tmp_path / "file").read_text() == "mine"
    nothing_left(tmp_path, "file")


@pytest.mark.parametrize("code", sorted(FS_ERRORS))
def test_prepare_on_a_full_or_read_only_disk_leaves_nothing(
    code: int, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import portatrain.data.prepare as prepare_mod

    real = prepare_mod._write_atomic

    def disk_fills_up(path: Path, data: bytes) -> None:
        if path.name.startswith("shard_"):
            path.with_name(path.name + ".tmp").write_bytes(data[: len(data) // 2])  # half written
            raise OSError(code, FS_ERRORS[code])
        real(path, data)

    monkeypatch.setattr(prepare_mod, "_write_atomic", disk_fills_up)
    status, err = run([*PREPARE, "out=corpus"], capsys)
    line = one_line_error(err, "prepare")
    assert status == 2 and FS_ERRORS[code] in line and "out=corpus" in line
    nothing_left(tmp_path)  # no .tmp shard, no half-made corpus directory


def test_prepare_keeps_complete_shards_for_a_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import portatrain.data.prepare as prepare_mod

    real = prepare_mod._write_atomic

    def full_after_first_shard(path: Path, data: bytes) -> None:
        if path.name.startswith("shard_00001"):
            path.with_name(path.name + ".tmp").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(prepare_mod, "_write_atomic", full_after_first_shard)
    status, err = run([*PREPARE, "out=corpus", "prepare.shard_chars=2000"], capsys)
    assert status == 2 and "1 complete shard(s) stay there" in one_line_error(err, "prepare")
    assert not list(tmp_path.rglob("*.tmp")) and (tmp_path / "corpus" / "shard_00000.json").is_file()
    monkeypatch.setattr(prepare_mod, "_write_atomic", real)
    status, err = run([*PREPARE, "out=corpus", "prepare.shard_chars=2000"], capsys)
    assert status == 0, err
    assert (tmp_path / "corpus" / "manifest.json").is_file()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.mix=[{dataset: builtin, weight: inf}]"], "data.mix[0].weight=inf must be a positive, finite"),
        (["data.mix=[{dataset: builtin, weight: 1}]", "data.dataset=x.jsonl"], "set together with data.mix"),
        (  # each weight finite, their sum not: random.choices' traceback
            ["data.mix=[{dataset: builtin, weight: 1e308}, {dataset: builtin, weight: 1e308}]"],
            "data.mix weights [1e+308, 1e+308] sum past the float range (1.8e+308); only their ratios "
            "matter: scale them down, e.g. weights [1, 1]",
        ),
    ],
)
@pytest.mark.parametrize("command", ["train", "prepare"])
def test_data_mix_mistakes_are_refused_by_validation(
    command: str, overrides: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["out=corpus"] if command == "prepare" else []
    status, err = run([command, *TINY, *out, *overrides], capsys)
    assert status == 2 and expected in err and "Traceback" not in err, err
    nothing_left(tmp_path)


def test_a_mix_drawn_outside_validation_refuses_weights_past_the_float_range() -> None:
    from portatrain.data.errors import DataError
    from portatrain.data.sources import iter_mixed

    with pytest.raises(DataError, match=r"sum past the float range .*e\.g\. weights \[1, 0\.8\]$"):
        next(iter_mixed(["a", "b"], [1.5e308, 1.2e308], open_source=lambda s: iter([{"text": s}])))


def test_damaged_prepared_shard_is_named_when_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = run([*PREPARE, "data.num_documents=100", "out=corpus"], capsys)
    assert status == 0, err
    shard = tmp_path / "corpus" / "shard_00000.bin"
    shard.write_bytes(b"\xff" * shard.stat().st_size)  # the size still matches the manifest
    status, err = run([*TINY, "data.dataset=corpus", "run_dir=run"], capsys)
    line = one_line_error(err, "train")
    assert status == 2 and str(Path("corpus") / "shard_00000.bin") in line
    assert "token id 65535" in line and "damaged" in line


def test_damaged_prepared_index_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from portatrain.data.errors import DataError
    from portatrain.data.prepare import prepare
    from portatrain.data.store import PreparedCorpus

    prepare(["builtin"], tmp_path / "c", num_documents=30, workers=1, progress=False)
    index = tmp_path / "c" / "shard_00000.idx"
    index.write_bytes(b"\xff" * index.stat().st_size)
    with pytest.raises(DataError, match=r"shard_00000\.idx: its document offsets"):
        PreparedCorpus(tmp_path / "c").lengths([0, 1])


# -- keys the schema lacks -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "nearest"),
    [
        ("trainer.stepz=50", "trainer.steps"),
        ("+trainer.stepz=50", "trainer.steps"),  # Hydra's own hint: it trained 4 steps, `stepz: 50` kept
        ("++optim.lrr=1", "optim.lr"),
        ("trainr.steps=3", "trainer.steps"),
        ("trainer.lr=1", "optim.lr"),
    ],
)
def test_a_key_the_schema_lacks_names_the_nearest_key_and_never_suggests_plus(
    override: str, nearest: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = run(["plan", *TINY, override], capsys)
    line = one_line_error(err, "plan")
    assert status == 2 and line.endswith(f"did you mean {nearest}?"), line
    assert f"{override}: {override.lstrip('+').split('=')[0]} is not a key of the config" in line
    assert "To append" not in err and "use +" not in err
    nothing_left(tmp_path)


def test_plus_still_adds_a_launch_environment_variable(capsys: pytest.CaptureFixture[str]) -> None:
    status, err = run(["--cfg", "job", *TINY, "+parallel.launch.env.NCCL_DEBUG=WARN"], capsys)
    assert status == 0, err
    assert "NCCL_DEBUG: WARN" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["model.dim=1000000", "model.n_layers=100000"], "model.n_layers=100,000 is above 10,000"),
        (["model.dim=2000000"], "model.dim=2,000,000 is above 1,048,576"),
    ],
)
def test_plan_refuses_sizes_past_any_model_with_the_bound(
    overrides: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first ran for minutes and gigabytes; the second planned a 2-million-wide model."""
    status, err = run(["plan", *TINY, *overrides], capsys)
    assert status == 2 and named in err and "Traceback" not in err, err
    nothing_left(tmp_path)


# -- export -------------------------------------------------------------------------------------------
def test_export_shard_size_zero_is_refused(checkpoint: Path, tmp_path: Path, capsys) -> None:
    status, err = run(["export", f"checkpoint={checkpoint}", "out=hf", "export.max_shard_size=0"], capsys)
    assert status == 2 and "export.max_shard_size=0 must be at least 1 byte" in err, err
    nothing_left(tmp_path)


def test_export_into_a_file_path_is_one_line(checkpoint: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("mine")
    status, err = run(["export", f"checkpoint={checkpoint}", "out=file/hf"], capsys)
    assert status == 2 and "Not a directory" in one_line_error(err, "export")
    nothing_left(tmp_path, "file")


@pytest.mark.parametrize("code", sorted(FS_ERRORS))
def test_export_on_a_full_or_read_only_disk_leaves_nothing(
    code: int, checkpoint: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch

    def save_file(tensors: object, filename: str, metadata: object = None) -> None:
        Path(filename).write_bytes(b"half")
        # What safetensors raises: its own exception type, the OS error only in the text.
        raise RuntimeError(f"Error while serializing: I/O error: {FS_ERRORS[code]} (os error {code})")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    status, err = run(["export", f"checkpoint={checkpoint}", "out=hf"], capsys)
    line = one_line_error(err, "export")
    assert status == 2 and FS_ERRORS[code] in line and "hf.tmp" in line
    nothing_left(tmp_path)


# -- render / submit / parity --------------------------------------------------------------------------
def test_render_refuses_a_time_slurm_does_not_read(tmp_path: Path, capsys) -> None:
    status, err = run(["render", *TINY, "launch.time=forever"], capsys)
    assert status == 2 and "launch.time='forever' is not a SLURM time limit" in err, err
    for good in ("90", "90:30", "24:00:00", "2-12", "2-12:30", "2-12:30:15", "UNLIMITED"):
        status, err = run(["render", *TINY, f"launch.time={good}"], capsys)
        assert status == 0 and f"#SBATCH --time={good}\n" in capsys.readouterr().out, (good, err)
    nothing_left(tmp_path)


def test_render_output_under_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("mine")
    status, err = run(["render", *TINY, "launch.output=file/job.sbatch"], capsys)
    assert status == 2 and "file: a file is there, where a directory belongs" in one_line_error(err, "render")
    nothing_left(tmp_path, "file")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_parity_on_a_missing_device_leaves_no_run_directory(tmp_path: Path, capsys) -> None:
    status, err = run(["parity", *TINY, "device=cuda"], capsys)
    line = one_line_error(err, "parity")
    assert status == 2 and "device=cuda was requested but cannot be used" in line
    nothing_left(tmp_path)


class _FailsAtStep(Trainer):
    """Raises a user error (as a damaged shard or a device out of memory would) at step ``FAIL_AT``."""

    FAIL_AT = 1

    def train_step(self, batches):
        if self.step + 1 == self.FAIL_AT:
            raise UserError(f"planted failure at step {self.FAIL_AT}")
        return super().train_step(batches)


def test_a_new_run_that_fails_on_a_user_error_before_saving_leaves_nothing(tmp_path: Path, capsys) -> None:
    """Its config and metrics would make the rerun of the same command refuse the directory as
    another run's; once a checkpoint exists, the run directory is kept."""
    run_dir = tmp_path / "run"
    argv = [*TINY, f"run_dir={run_dir}", "checkpoint.every=2", "trainer.steps=4"]
    with pytest.raises(SystemExit) as exit_info:
        main(trainer_cls=_FailsAtStep, argv=argv)
    assert exit_info.value.code == 2 and "planted failure at step 1" in capsys.readouterr().err
    assert not run_dir.exists()
    _FailsAtStep.FAIL_AT = 3  # after the step-2 checkpoint
    try:
        with pytest.raises(SystemExit):
            main(trainer_cls=_FailsAtStep, argv=argv)
    finally:
        _FailsAtStep.FAIL_AT = 1
    assert (run_dir / "checkpoints" / "step_0000002").is_dir() and (run_dir / "config.yaml").is_file()
