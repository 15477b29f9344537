"""``portatrain audit``'s user errors: one line on stderr, exit 2, nothing partial left behind.

A file that is not Python is refused (not parsed into a "syntax error"); an ``-o`` report whose
folder is missing, which is a folder itself, or whose disk is read-only or full (made so by the
operating system's call raising ``EROFS``/``ENOSPC``: as root, ``chmod`` cannot) is named with
its fix, and neither a partial report nor a temporary file is left.
"""

from __future__ import annotations

import errno
import os
import tokenize
from pathlib import Path

import pytest

from portatrain.audit import AuditError, audit_paths
from portatrain.audit.cli import main
from tests.helpers import ROOT, run_cli

FIXTURE = ROOT / "tests" / "fixtures" / "audit" / "kernels.py"


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert "Traceback" not in captured.err and len(lines) == 1, captured.err
    assert lines[0].startswith("portatrain audit: error: "), lines
    assert captured.out == ""
    return lines[0]


def test_a_file_that_is_not_python_is_refused(tmp_path: Path, capsys) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nIt's `torch.cuda.synchronize()` here.\n")
    assert main([str(notes), "--no-config"]) == 2
    line = one_line_error(capsys)
    assert f"not a Python file: {notes}" in line and "pass Python files, or folders" in line
    with pytest.raises(AuditError, match="not a Python file"):
        audit_paths([FIXTURE, notes])


def test_a_script_with_a_python_shebang_is_audited(tmp_path: Path) -> None:
    script = tmp_path / "train"  # no suffix: a script run as ./train
    script.write_text("#!/usr/bin/env python3\nimport torch\ntorch.cuda.synchronize()\n")
    assert [(f.rule, f.line) for f in audit_paths([script]).findings] == [("cuda-api", 3)]


def test_readme_through_the_portatrain_command() -> None:
    proc = run_cli(["audit", "README.md"], cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "portatrain audit: error: not a Python file: README.md (the name does not end in "
        ".py/.pyw/.pyi and the first line is no python shebang); pass Python files, or folders "
        "(their *.py files are audited)"
    ]


def test_an_unreadable_file_is_named(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def denied(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(tokenize, "open", denied)
    assert main([str(FIXTURE), "--no-config"]) == 2
    line = one_line_error(capsys)
    assert "cannot read" in line and "kernels.py" in line and os.strerror(errno.EACCES) in line


@pytest.mark.parametrize("where", ["missing", "file"])
def test_output_folder_missing_or_a_file(where: str, tmp_path: Path, capsys) -> None:
    if where == "missing":
        output = tmp_path / "no" / "such" / "dir" / "out.sarif"
        expected = f"-o {output}: the folder {output.parent} does not exist; create it first"
    else:
        (tmp_path / "no").write_text("a file")
        output = tmp_path / "no" / "out.sarif"
        expected = f"-o {output}: {output.parent} is a file, not a folder"
    assert main([str(FIXTURE), "--no-config", "--format", "sarif", "-o", str(output)]) == 2
    assert expected in one_line_error(capsys)
    assert not (tmp_path / "no" / "such").exists()


def test_output_folder_missing_through_the_portatrain_command(tmp_path: Path) -> None:
    proc = run_cli(["audit", str(FIXTURE), "-o", "no/such/dir/out.sarif"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "portatrain audit: error: -o no/such/dir/out.sarif: the folder no/such/dir does not exist; "
        "create it first (mkdir -p no/such/dir), or write the report elsewhere"
    ]
    assert list(tmp_path.iterdir()) == []


def test_output_that_is_a_folder(tmp_path: Path, capsys) -> None:
    assert main(["--list-rules", "-o", str(tmp_path)]) == 2
    assert f"-o {tmp_path} is a directory; name a file in it" in one_line_error(capsys)


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
@pytest.mark.parametrize("existing", [False, True])
def test_read_only_or_full_disk_leaves_no_partial_report(
    code: int, existing: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    output = tmp_path / "audit.json"
    if existing:
        output.write_text("the previous report\n")

    def failing_write(self: Path, data: str, *args, **kwargs) -> int:
        if code == errno.ENOSPC:  # the disk fills part way through the report
            with open(self, "w") as handle:
                handle.write(data[: len(data) // 2])
        raise OSError(code, os.strerror(code), str(self))

    monkeypatch.setattr(Path, "write_text", failing_write)
    assert main([str(FIXTURE), "--no-config", "--format", "json", "-o", str(output)]) == 2
    line = one_line_error(capsys)
    assert f"-o {output}: cannot write the report ({os.strerror(code)})" in line
    assert "choose a writable location with free space" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == (["audit.json"] if existing else [])
    if existing:
        assert output.read_text() == "the previous report\n"


def test_output_is_written_whole(tmp_path: Path) -> None:
    output = tmp_path / "audit.json"
    output.write_text("the previous report\n")
    assert main([str(FIXTURE), "--no-config", "--format", "json", "-o", str(output)]) == 1
    assert '"schema": "portatrain.audit/1"' in output.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["audit.json"]  # no temporary file left
