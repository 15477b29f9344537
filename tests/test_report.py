"""``portatrain report``: the checklist's verdicts from evidence (pure, in-process), its files, and the
command end to end on the CPU (the CUDA-first script as extra code) and on the sim device (the port)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from portatrain.config import ReportConfig
from portatrain.report import (
    FAIL,
    NOT_MEASURED,
    PASS,
    SCHEMA,
    STATUSES,
    Commands,
    Evidence,
    checklist,
    level_verdicts,
    render_markdown,
    report_problems,
    static_audit,
    write_report,
)
from tests.helpers import ROOT, python

COMMANDS = Commands(
    audit="portatrain audit --format json x.py",
    train="portatrain train recipe=debug device=D audit.runtime=true",
    bench="portatrain bench recipe=debug device=D",
    parity="portatrain parity recipe=debug device=D",
    report="portatrain report recipe=debug device=D",
)
CLEAN_STATIC = static_audit([str(ROOT / "examples" / "ported_train.py")])
DIRTY_STATIC = static_audit([str(ROOT / "examples" / "cuda_first_train.py")])


def _runtime(device_type: str, counted: bool) -> dict[str, Any]:
    """A runtime-audit summary as :func:`portatrain.report.runtime_run` returns it."""
    count = 0 if counted else None
    return {
        "device": f"{device_type}:0",
        "device_type": device_type,
        "simulated": device_type == "sim",
        "windows": 2,
        "steps": 6,
        "host_syncs": count,
        "cpu_fallbacks": count,
        "mixed_device": count,
        "graph_breaks": 0,
        "recompiles": 0,
        "graphs": 0,
        "offences": {},
        "first": {},
        "per_window": [{"step": 3, "audit_steps": 3, "audit_host_syncs": count}] * 2,
        "graph_breaks_whole_run": 0,
        "graph_break_reasons": [],
        "graphs_whole_run": 0,
        "compile": False,
        "losses": [4.9, 4.0],
        "dtype": "float32",
        "shapes_seen": [[4, 64]],
        "shapes_configured": [[4, 64]],
        "unsupported_ops": {} if device_type == "sim" else None,
    }


BENCH = {
    "tokens_per_s": 4000.0,
    "step_time_median_s": 0.05,
    "measured_steps": 4,
    "mfu": 0.25,
    "cold_start_s": 0.4,
    "setup_s": 0.3,
    "first_step_s": 0.1,
    "compile": False,
    "cost_per_million_tokens": None,
    "price_per_hour": None,
    "device_name": "x",
}
PARITY_OK = {
    "ok": True,
    "steps": 3,
    "tolerance": 1e-4,
    "dtype": "float32",
    "first_divergence": None,
    "losses": [[5.6, 5.6], [5.2, 5.2], [4.9, 4.9]],
}


def _evidence(device: str = "cpu", **changes: Any) -> Evidence:
    counted = device == "sim"
    ev = Evidence(
        static=CLEAN_STATIC,
        runtime=_runtime(device, counted),
        bench=dict(BENCH),
        parity={"skipped": "the device is the fp32 CPU reference itself"}
        if device == "cpu"
        else dict(PARITY_OK),
        device=device,
        simulated=counted,
        report_cfg=ReportConfig(),
        commands=Commands(
            **{k: v.replace("device=D", f"device={device}") for k, v in vars(COMMANDS).items()}
        ),
    )
    for key, value in changes.items():
        setattr(ev, key, value)
    return ev


def _by_id(items: list) -> dict[str, Any]:
    return {item.id: item for item in items}


def test_nothing_passes_without_a_measurement() -> None:
    items = _by_id(checklist(_evidence("cpu")))
    assert {i.status for i in items.values()} <= set(STATUSES)
    # No counter on the CPU, parity against itself, no target, no price: not measured, never pass.
    for key in ("1.3", "2.2", "3.1", "5.1", "5.4", "6.1", "6.2", "6.3"):
        assert items[key].status == NOT_MEASURED, (key, items[key])
        assert items[key].command, key  # the command that would measure it
    assert "device=sim" in items["5.4"].command and "device=sim" in items["1.3"].command
    assert items["3.1"].command.startswith("portatrain parity")
    assert "report.min_tokens_per_s=" in items["5.1"].command and "4,000 tokens/s" in items["5.1"].evidence
    assert "bench.price_per_hour=" in items["6.1"].command
    # What passes was measured: a static scan, the run's steps and losses, the cold start.
    assert [k for k, i in items.items() if i.status == PASS] == [
        "1.1",
        "1.2",
        "2.1",
        "3.2",
        "4.1",
        "5.2",
        "5.3",
        "0.1",
    ]
    assert "6 optimizer steps of the Trainer on cpu:0" in items["1.2"].evidence
    assert "within report.max_cold_start_s=120.0" in items["5.2"].evidence
    assert not any(i.simulated for i in items.values())
    # Compilation off: graph breaks and recompiles are not measured, and the command turns it on.
    assert items["4.2"].status == NOT_MEASURED and items["4.2"].command.endswith("compile.enabled=true")


def test_a_simulated_run_says_so_on_every_line(tmp_path: Path) -> None:
    cfg = ReportConfig(min_tokens_per_s=1.0, max_cost_per_million_tokens=1e9)  # targets that would pass
    bench = dict(BENCH, cost_per_million_tokens=0.5, price_per_hour=1.0)
    ev = _evidence("sim", report_cfg=cfg, bench=bench)
    items = checklist(ev)
    assert all(i.simulated for i in items)
    by_id = _by_id(items)
    assert by_id["5.4"].status == PASS and "0 in 6 steps" in by_id["5.4"].evidence
    assert by_id["3.1"].status == PASS
    # Sim timings are the host CPU's: performance and cost are not measured, whatever the targets.
    for key in ("5.1", "5.2", "6.1"):
        assert by_id[key].status == NOT_MEASURED and "host CPU's" in by_id[key].evidence
        assert "device=tpu|neuron" in by_id[key].command
    # No op marked unsupported: nothing could fall back, so the zero proves nothing.
    assert by_id["2.2"].status == NOT_MEASURED and "SIM_UNSUPPORTED_OPS" in by_id["2.2"].command
    marked = copy.deepcopy(ev.runtime)
    marked["unsupported_ops"] = {"aten::rsqrt": "count"}
    assert _by_id(checklist(_evidence("sim", runtime=marked)))["2.2"].status == PASS

    document = {
        "recipe": "debug",
        "device": "sim:0",
        "device_name": "portatrain sim",
        "simulated": True,
        "generated": "now",
        "command": ev.commands.report,
        "levels": {str(k): v for k, v in level_verdicts(items).items()},
        "items": [vars(i) for i in items],
        "evidence_files": {"runtime audit": "runtime/metrics.jsonl"},
        "static": CLEAN_STATIC,
    }
    markdown = render_markdown(document)
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [r for r in rows if not r.startswith(("| level", "| | check"))]
    assert len(rows) == len(items) + 7  # every item, and every level's verdict
    assert all("[simulated device]" in row for row in rows)
    assert markdown.startswith("# Portability report: debug on sim:0 [simulated device]")


def test_failures_name_what_failed() -> None:
    runtime = _runtime("sim", counted=True)
    runtime.update(
        host_syncs=3,
        offences={"sync:item": 3},
        first={"sync:item": "train.py:12 in compute_loss"},
        per_window=[{"step": 3, "audit_steps": 3, "audit_host_syncs": 3}],
        shapes_seen=[[4, 64], [4, 37]],
    )
    parity = dict(PARITY_OK, ok=False)
    parity["first_divergence"] = {"step": 1, "kind": "activation", "name": "layers.0.mlp", "rel": 0.5}
    items = _by_id(checklist(_evidence("sim", static=DIRTY_STATIC, runtime=runtime, parity=parity)))
    assert items["1.1"].status == FAIL and "cuda_first_train.py:" in items["1.1"].evidence
    assert (
        items["5.4"].status == FAIL
        and "sync:item x3, first at train.py:12 in compute_loss" in items["5.4"].evidence
    )
    assert items["3.1"].status == FAIL and "'layers.0.mlp'" in items["3.1"].evidence
    assert items["4.1"].status == FAIL and "[4, 37]" in items["4.1"].evidence
    assert items["0.1"].status == FAIL and "pickle" in items["0.1"].evidence

    broken = _by_id(checklist(_evidence("cpu", runtime={"error": "DeviceUnavailableError: no tpu"})))
    for key in ("1.2", "1.3", "2.2", "3.2", "4.1", "4.2", "4.3", "5.4"):
        assert broken[key].status == FAIL and "no tpu" in broken[key].evidence, key
    assert level_verdicts(list(broken.values()))[1] == FAIL


def test_the_loops_wait_on_checkpoints_is_judged_on_hardware_only() -> None:
    def item(device: str, frac: float | None) -> Any:
        ev = _evidence(device)
        ev.runtime = dict(ev.runtime, checkpoint_blocked_frac=frac, checkpoint_async_mode="none")
        return _by_id(checklist(ev))["0.2"]

    assert item("cpu", None).status == NOT_MEASURED
    assert item("cpu", 0.04).status == PASS and "4.0% of its wall time" in item("cpu", 0.04).evidence
    slow = item("cpu", 0.26)
    assert slow.status == FAIL and slow.command.endswith("checkpoint.async_mode=thread")
    assert item("sim", 0.26).status == NOT_MEASURED


def test_targets_turn_measurements_into_verdicts() -> None:
    fast = _by_id(checklist(_evidence("cpu", report_cfg=ReportConfig(min_tokens_per_s=1000, min_mfu=0.2))))
    assert fast["5.1"].status == PASS and "meets report.min_tokens_per_s=1000" in fast["5.1"].evidence
    slow = _by_id(
        checklist(_evidence("cpu", report_cfg=ReportConfig(min_tokens_per_s=1e6, max_cold_start_s=0.1)))
    )
    assert slow["5.1"].status == FAIL and slow["5.2"].status == FAIL
    priced = _by_id(
        checklist(
            _evidence(
                "cpu",
                report_cfg=ReportConfig(max_cost_per_million_tokens=0.1),
                bench=dict(BENCH, cost_per_million_tokens=0.07, price_per_hour=1.0),
            )
        )
    )
    assert priced["6.1"].status == PASS and "$0.07 per million tokens" in priced["6.1"].evidence


def test_report_config_problems() -> None:
    assert report_problems(ReportConfig()) == []
    problems = report_problems(ReportConfig(steps=1, bench_steps=0, min_mfu=-1))
    assert len(problems) == 3 and "report.steps=1 must be >= 2" in problems[0]


def test_write_report_to_the_run_dir_and_out(tmp_path: Path) -> None:
    document = {"schema": SCHEMA, "items": [], "levels": {str(k): NOT_MEASURED for k in range(7)}}
    document.update(recipe="r", device="cpu:0", device_name="cpu", simulated=False, generated="now")
    document.update(command="portatrain report", evidence_files={}, static=CLEAN_STATIC)
    written = write_report(document, tmp_path / "run", str(tmp_path / "out" / "port.md"))
    assert sorted(p.name for p in written) == ["port.json", "port.md", "report.json", "report.md"]
    assert json.loads((tmp_path / "out" / "port.json").read_text())["schema"] == SCHEMA
    write_report(document, tmp_path / "run", str(tmp_path / "folder"))
    assert (tmp_path / "folder" / "report.md").is_file()


SMALL = ["data.num_documents=200", "data.seq_len=64", "data.batch_size=4", "optim.warmup_steps=2"]


def _report(args: list[str], tmp_path: Path, script: str | None = None) -> tuple[int, dict[str, Any], str]:
    program = python(script) if script else python("-m", "portatrain")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [*program, "report", *SMALL, f"run_dir={tmp_path / 'run'}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    document = json.loads((tmp_path / "run" / "report.json").read_text())
    return proc.returncode, document, proc.stdout


@pytest.mark.slow  # three short runs (runtime audit, bench) on the CPU: ~20 s
def test_report_on_cpu_audits_the_extra_script(tmp_path: Path) -> None:
    code, document, stdout = _report(
        ["device=cpu", "paths=[examples/cuda_first_train.py]", f"out={tmp_path / 'copy.md'}"], tmp_path
    )
    assert code == 1  # the CUDA-first script fails levels 1 and 2
    assert document["schema"] == SCHEMA and document["simulated"] is False
    items = {i["id"]: i for i in document["items"]}
    assert items["1.1"]["status"] == FAIL and "examples/cuda_first_train.py:" in items["1.1"]["evidence"]
    assert items["2.1"]["status"] == FAIL and "flash_attn" in items["2.1"]["evidence"]
    assert (
        items["1.2"]["status"] == PASS
        and "6 optimizer steps of portatrain.trainer.Trainer on cpu:0" in items["1.2"]["evidence"]
    )
    assert items["5.4"]["status"] == NOT_MEASURED and items["3.1"]["status"] == NOT_MEASURED
    assert items["5.2"]["status"] == PASS  # the bench measured the cold start
    assert "examples/cuda_first_train.py" in document["static"]["paths"]
    assert document["runtime"]["host_syncs"] is None
    assert (tmp_path / "copy.md").read_text() == (tmp_path / "run" / "report.md").read_text()
    assert "# Portability report: debug on cpu:0\n" in stdout
    assert "paths=" not in items["1.2"]["command"] and "run_dir=" not in items["1.2"]["command"]


@pytest.mark.slow  # runtime audit, parity (sim + CPU reference) and bench on the sim device: ~30 s
def test_report_on_sim_of_the_ported_script(tmp_path: Path) -> None:
    code, document, stdout = _report(["device=sim"], tmp_path, script="examples/ported_train.py")
    items = {i["id"]: i for i in document["items"]}
    assert code == 0, [i for i in document["items"] if i["status"] == FAIL]
    assert document["simulated"] is True and all(i["simulated"] for i in document["items"])
    assert "examples/ported_train.py" in document["static"]["paths"]  # the Trainer subclass in use
    assert items["5.4"]["status"] == PASS and items["5.4"]["evidence"].startswith("0 in 6 steps")
    assert items["1.3"]["status"] == PASS
    assert items["1.2"]["command"].startswith("python examples/ported_train.py train")
    if "skipped" not in document["parity"]:  # parity is measured where the command exists
        assert items["3.1"]["status"] == PASS
    rows = [line for line in stdout.splitlines() if line.startswith(("| 1.", "| 2.", "| 5.", "| 6."))]
    assert rows and all("[simulated device]" in row for row in rows)


class _ResearchTrainer:
    """Stands in for a research Trainer subclass defined in this file."""


def test_code_in_use_is_the_subclass_the_model_family_and_the_kernels() -> None:
    from omegaconf import OmegaConf

    from portatrain.report import code_in_use

    cfg = OmegaConf.create(
        {"model": {"name": "llama3"}, "kernels": {"enabled": ["pallas_interpret_rmsnorm"]}}
    )
    paths = code_in_use(cfg, _ResearchTrainer, ["examples/cuda_first_train.py"])  # type: ignore[arg-type]
    assert paths[0] == "examples/cuda_first_train.py"
    assert any(p.endswith("tests/test_report.py") for p in paths)  # where the Trainer subclass lives
    assert any(p.endswith("src/portatrain/models/llama") for p in paths)
    assert any(p.endswith("src/portatrain/kernels/pallas") for p in paths)
    assert len(paths) == 4
