"""A non-editable install (a built wheel) resolves its configs and recipes from inside the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_install_resolves_configs(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("portatrain-*.whl")
    venv = tmp_path / "venv"
    # System site-packages provide torch & co.; the venv holds only the wheel, which shadows the checkout.
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120
    )
    subprocess.run([venv / "bin" / "pip", "install", "--no-deps", "-q", str(wheel)], check=True, timeout=300)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    out = subprocess.run(
        [venv / "bin" / "portatrain", "--cfg", "job", "recipe=llama8b", "device=cpu"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "recipe: llama8b" in out.stdout and "flavor: 8b" in out.stdout
    where = subprocess.run(
        [venv / "bin" / "python", "-c", "import portatrain.cli as c; print(c.config_dir())"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert str(venv) in where.stdout, where.stdout
