"""``device=sim`` failures are one clear line: bad settings name their own fix (not the compiler
hint), ``SIM_DEVICE_COUNT=0`` is refused, an over-capacity allocation and an unsupported op hit
under the action ``error`` are user errors (exit 2, one line), not tracebacks.

Each check runs in a fresh process: installing the sim device renames torch's PrivateUse1 backend
for good. The first sim test of a fresh CI run pays the extension build (cached afterwards).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_cli
from tests.test_sim import run_python

TRAIN = [
    "train",
    "recipe=debug",
    "device=sim",
    "trainer.steps=2",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "checkpoint.enabled=false",
    "data.num_documents=64",
]

BAD_SETTINGS = {
    "SIM_UNSUPPORTED_ACTION": (
        "explode",
        "SIM_UNSUPPORTED_ACTION='explode' is not one of count, warn, error",
    ),
    "PORTATRAIN_SIM_AS": ("gpu", "PORTATRAIN_SIM_AS='gpu' must be one of sim, tpu, neuron"),
    "SIM_MEMORY_CAPACITY": ("lots", "SIM_MEMORY_CAPACITY='lots' is not a size"),
    "SIM_COUNTERS_MODE": ("loud", "SIM_COUNTERS_MODE='loud' is not one of count, warn, raise"),
    "SIM_DEVICE_COUNT": ("0", "SIM_DEVICE_COUNT='0' is not a device count from 1 to 64"),
}


def _one_error_line(proc) -> str:  # noqa: ANN001 - a CompletedProcess
    """The run's single stderr line (``portatrain train: error: ...``) after checking exit 2."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("portatrain train: error: "), proc.stderr[-3000:]
    return errors[0]


def test_each_bad_setting_names_its_own_fix_and_changes_nothing() -> None:
    """Every setting in turn, then all at once, through ``resolve_accelerator("sim")`` (what
    ``device=sim`` calls) and ``runtime.install()``; then a device index past the count."""
    out = run_python(
        f"""
        import json, os, torch
        from portatrain.accelerators import resolve_accelerator
        from portatrain.errors import UserError
        from portatrain.accelerators.sim import runtime
        bad = {json.dumps({k: v for k, (v, _) in BAD_SETTINGS.items()})}
        out = {{}}
        for key, value in [*bad.items(), ("all", None)]:
            env = bad if key == "all" else {{key: value}}
            os.environ.update(env)
            try:
                for call in (lambda: resolve_accelerator("sim"), runtime.install):
                    try:
                        call()
                        out.setdefault(key, []).append("no error")
                    except UserError as exc:
                        out.setdefault(key, []).append(str(exc))
            finally:
                for name in env:
                    os.environ.pop(name)
        out["renamed"] = torch._C._get_privateuse1_backend_name()
        try:
            resolve_accelerator("sim", 7)
            out["index"] = "no error"
        except UserError as exc:
            out["index"] = str(exc)
        print(json.dumps(out))
        """
    )
    result = json.loads(out.strip().splitlines()[-1])
    for key, (_, expected) in BAD_SETTINGS.items():
        for message in result[key]:
            assert message.startswith("device=sim: ") and expected in message, (key, message)
            assert "C++ compiler" not in message and "g++" not in message, (key, message)
            assert "\n" not in message
    assert all(all(e in m for _, e in BAD_SETTINGS.values()) for m in result["all"]), result["all"]
    assert result["renamed"] == "privateuseone"  # refused before anything was installed
    index = result["index"]
    assert "4 sim device(s)" in index and "need index 7" in index and "SIM_DEVICE_COUNT=8" in index
    assert "C++ compiler" not in index


def test_device_count_zero_is_refused_in_one_line(tmp_path: Path) -> None:
    proc = run_cli([*TRAIN, f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, env={"SIM_DEVICE_COUNT": "0"})
    line = _one_error_line(proc)
    assert "SIM_DEVICE_COUNT='0' is not a device count from 1 to 64" in line


def test_out_of_memory_is_one_line_naming_the_capacity(tmp_path: Path) -> None:
    proc = run_cli([*TRAIN, f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, env={"SIM_MEMORY_CAPACITY": "1MiB"})
    line = _one_error_line(proc)
    assert "sim out of memory on device 0" in line and "of 1.00 MiB capacity (SIM_MEMORY_CAPACITY)" in line
    assert "raise SIM_MEMORY_CAPACITY" in line


def test_unsupported_op_under_error_is_one_line_naming_the_op(tmp_path: Path) -> None:
    env = {"SIM_UNSUPPORTED_OPS": "aten::rsqrt", "SIM_UNSUPPORTED_ACTION": "error"}
    proc = run_cli([*TRAIN, f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)
    line = _one_error_line(proc)
    assert "[sim] fallback:aten::rsqrt" in line and "is marked unsupported with the action error" in line
    # The line points at portatrain's code that called it, not at torch's internals.
    assert "called from " in line and "site-packages/torch" not in line
    assert "SIM_UNSUPPORTED_ACTION=count" in line
