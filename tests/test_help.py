"""``portatrain COMMAND --help`` for every command: purpose, options with their defaults, one example."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from portatrain.cli import config_dir
from portatrain.commands import COMMANDS, command_overrides, load_command, shorthands, uses_hydra
from portatrain.commands.usage import options, usage
from portatrain.config import Config
from tests.helpers import compose_config, run_cli


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_of_every_command_has_purpose_options_and_an_example(name: str) -> None:
    module = load_command(name)
    text = usage(name, config_dir())
    first = text.splitlines()[0]
    assert first.startswith(f"portatrain {name}: ") and len(first) > len(f"portatrain {name}: ") + 10
    example = module.EXAMPLE
    assert f"example:\n  {example}" in text
    words = shlex.split(example)
    assert words[0] == "portatrain"
    if not uses_hydra(module):
        assert words[1] == name
        return
    # Every option of the sections it lists, with the schema's default; the common keys too.
    sections = {
        f.name: type(f.default_factory())
        for f in dataclasses.fields(Config)
        if f.default_factory is not dataclasses.MISSING
    }
    for section in module.SECTIONS:
        for key, default, _ in options(section, sections[section]):
            assert f"  {key}" in text and f"[{default}]" in text, key
    assert "recipe" in text and "[debug]" in text and "device.type" in text
    # The example composes: its keys exist in the schema (a misspelled key would fail here).
    args = words[2:] if words[1] == name else words[1:]
    keys = shorthands(module)
    overrides = [
        f"{keys[a.split('=')[0]]}={a.split('=', 1)[1]}" if a.split("=")[0] in keys else a for a in args
    ]
    compose_config([*command_overrides(module), *overrides])


def test_help_runs_from_the_command_line(tmp_path: Path) -> None:
    out = run_cli(["export", "--help"], cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("portatrain export: ") and "export.max_shard_size  [5GB]" in out.stdout
    assert not list(tmp_path.iterdir())  # no run directory
    out = run_cli(["audit", "--help"], cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("portatrain audit: ") and "usage: portatrain audit" in out.stdout
    out = run_cli(["--help"], cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert all(f"\n  {name} " in out.stdout for name in COMMANDS) and "== Config ==" in out.stdout
