"""A non-editable install (a built wheel) resolves its configs and recipes from inside the package.

The wheel is installed with ``pip install --no-deps --target DIR`` and run by the *current*
interpreter with ``PYTHONPATH=DIR``: its dependencies (torch, hydra...) are whatever this interpreter
has -- a fresh virtualenv's or the system's -- and ``DIR`` comes first on ``sys.path``, so the wheel
shadows the editable checkout. (A ``--system-site-packages`` venv built from ``sys.executable``
would see the *base* interpreter's packages when the tests run in a virtualenv, not this one's.)
"""

from __future__ import annotations

import os
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
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "portatrain", "--cfg", "job", "recipe=llama8b", "device=cpu"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "recipe: llama8b" in out.stdout and "flavor: 8b" in out.stdout
    where = subprocess.run(
        [sys.executable, "-c", "import portatrain.cli as c; print(c.__file__); print(c.config_dir())"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    module_file, conf = where.stdout.split()
    assert module_file.startswith(str(target)) and conf.startswith(str(target)), where.stdout + where.stderr
    assert (Path(conf) / "config.yaml").is_file()
