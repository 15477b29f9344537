"""Op-coverage profiles of the sim device (``SIM_OP_PROFILE``; ``portatrain.accelerators.sim.op_profiles``).

In-process: the shipped profiles say where they came from and how complete they are; a bad
``SIM_OP_PROFILE`` is one line naming the value and the fix; the build script reads torch-xla's
lowerings; the report judges an op census against every profile. In one fresh process on the sim
(installing it is process-global): every family's training step run under each profile, the
operators outside it really taking the CPU fallback (same losses as without a profile) and counted
exactly as the census judges them; a planted unsupported op named by the runtime audit and the report.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from portatrain.accelerators.sim import op_profiles
from portatrain.accelerators.sim.settings import settings_problems
from portatrain.report import FAIL, PASS, checklist
from portatrain.report.coverage import device_plan, findings_by_rule, op_coverage
from tests.helpers import ROOT, compose_config
from tests.test_report import _evidence
from tests.test_sim import run_python

FAMILIES = ("llama3", "qwen3", "olmo2", "qwen3_moe")


def test_each_impersonation_has_a_sourced_profile() -> None:
    assert op_profiles.available() == ("neuron", "tpu")
    for name, profile in op_profiles.load_all().items():
        assert profile.name == name and profile.sources and profile.completeness and profile.unlisted
        assert all(s["where"].startswith("https://") for s in profile.sources)
        # The matmuls, softmax and the embedding of every decoder run on the device.
        for op in ("aten::mm.out", "aten::bmm", "aten::_softmax.out", "aten::embedding_dense_backward"):
            assert profile.is_native(op), (name, op)
        assert not profile.is_native("aten::copysign.out")  # in neither vendor's list
        assert profile.is_native("c10d::allreduce_")  # communication is the backend's, not the profile's
    tpu = op_profiles.load("tpu")
    assert "torch_tpu" in tpu.sources[0]["file"] and len(tpu.sources[0]["sha256"]) == 64
    assert "cpu_fallback" in tpu.unlisted and "NotImplementedError" in tpu.unlisted
    neuron = op_profiles.load("neuron")
    assert "xla_native_functions.yaml" in neuron.sources[0]["where"]
    assert "torch_api_compatibility.md" in neuron.completeness  # what it could not read, said
    # repeat is one TorchTPU-less, torch-xla kernel: registered whole for the sim under neuron.
    assert "repeat" in neuron.leaf_composites() and "_to_copy" not in neuron.leaf_composites()


def test_a_bad_profile_setting_is_one_line_with_the_fix(tmp_path: Path) -> None:
    assert settings_problems({"SIM_OP_PROFILE": "tpu"}) == []
    assert settings_problems({"SIM_OP_PROFILE": "none"}) == []
    (problem,) = settings_problems({"SIM_OP_PROFILE": "gpu"})
    assert "SIM_OP_PROFILE='gpu'" in problem and "neuron, tpu" in problem and "unset it" in problem
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "something/else"}))
    (problem,) = settings_problems({"SIM_OP_PROFILE": str(bad)})
    assert "is not an op profile" in problem and "scripts/build_op_profiles.py" in problem


def _build_script():
    spec = importlib.util.spec_from_file_location(
        "build_op_profiles", ROOT / "scripts" / "build_op_profiles.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_build_script_reads_the_xla_lowerings(tmp_path: Path) -> None:
    yaml = tmp_path / "xla_native_functions.yaml"
    yaml.write_text(
        "backend: XLA\nfull_codegen:\n  - abs\n  - add.Tensor\nir_gen:\n  - baddbmm\n"
        "supported:\n  - mm\n  - view_copy\nautograd:\n  - einsum\n"
    )
    profile = _build_script().neuron_profile(str(yaml), "0" * 40)
    assert profile["registered"] == [
        "aten::abs",
        "aten::add.Tensor",
        "aten::baddbmm",
        "aten::einsum",
        "aten::mm",
        "aten::view_copy",
    ]
    # Functionalization's in-place and view forms map onto the lowered ones.
    assert {"aten::add", "aten::add_", "aten::view"} <= set(profile["native"])
    assert profile["sources"][0]["sha256"] and "0000000000" in profile["backend"]
    # AWS's list, checked against these lowerings: most of it is missing from this toy yaml.
    assert "aten::bmm" in profile["sources"][1]["documented_but_not_lowered"]


def _profile_run(fallbacks: dict[str, int], first: dict[str, str], operators: int = 40) -> dict:
    """A runtime-audit summary of a run made with a profile in force (what ``profile_runs`` returns)."""
    run = dict(_evidence("sim").runtime, ops={f"aten::op{i}": 1 for i in range(operators)})
    run["offences"] = {f"fallback:{op}": n for op, n in fallbacks.items()}
    run["first"] = {f"fallback:{op}": where for op, where in first.items()}
    return run


def test_report_judges_fallbacks_under_each_profile() -> None:
    where = {"aten::copysign.out": "model.py:7 in forward", "aten::unfold": "moe.py:3 in forward"}
    coverage = op_coverage(
        {
            "tpu": _profile_run({"aten::copysign.out": 2}, where),
            "neuron": _profile_run({"aten::copysign.out": 2, "aten::unfold": 4}, where),
        }
    )
    assert coverage["tpu"]["fallbacks"] == {"aten::copysign.out": 2} and coverage["tpu"]["operators"] == 40
    assert coverage["neuron"]["first"]["aten::unfold"] == "moe.py:3 in forward"
    assert "TorchTPU" in coverage["tpu"]["backend"] and coverage["tpu"]["completeness"]
    item = {i.id: i for i in checklist(_evidence("sim", coverage=coverage))}["2.2"]
    assert item.status == FAIL
    assert "aten::copysign.out x2, first at model.py:7 in forward" in item.evidence
    assert "neuron profile: 2 of 40 operators" in item.evidence and "tpu profile: 1 of 40" in item.evidence
    # Impersonating a TPU, only the TPU profile judges; a run with nothing outside it passes.
    tpu = dict(_evidence("sim").runtime, device_type="tpu")
    clean = op_coverage({"tpu": _profile_run({}, {}), "neuron": _profile_run({"aten::unfold": 4}, where)})
    item = {i.id: i for i in checklist(_evidence("sim", runtime=tpu, coverage=clean))}["2.2"]
    assert item.status == PASS and item.evidence.endswith("tpu profile: all 40 operators run on the device")
    assert item.command.startswith("SIM_OP_PROFILE=tpu ")
    # A run that failed under a profile fails the item, saying so.
    failed = op_coverage({"tpu": {"error": "RuntimeError: boom"}})
    item = {i.id: i for i in checklist(_evidence("sim", runtime=tpu, coverage=failed))}["2.2"]
    assert item.status == FAIL and "the run failed: RuntimeError: boom" in item.evidence


def test_report_lists_findings_by_rule_and_the_plan_on_the_device() -> None:
    static = {
        "findings": [
            {"rule": "PT101", "level": 1, "severity": "error", "path": "a.py", "line": 3},
            {"rule": "PT101", "level": 1, "severity": "warning", "path": "a.py", "line": 9},
            {"rule": "PT501", "level": 5, "severity": "warning", "path": "b.py", "line": 1},
        ]
    }
    rules = findings_by_rule(static)
    assert rules["PT101"] == {
        "level": 1,
        "count": 2,
        "severity": {"error": 1, "warning": 1},
        "first": "a.py:3",
    }
    assert list(rules) == ["PT101", "PT501"]
    moe = device_plan(compose_config(["model=qwen3_moe_debug", "device=sim"]))
    assert moe["moe_dispatch"] == "capacity" and moe["moe_dispatch_configured"] == "auto"
    assert device_plan(compose_config(["model=qwen3_moe_debug", "device=cpu"]))["moe_dispatch"] == "dropless"
    dense = device_plan(compose_config(["model=llama3_debug", "device=sim"]))
    assert dense["moe_dispatch"] is None and "pp_schedule" in dense


@pytest.mark.slow  # one fresh process: 4 families x (census + 2 profiles) of 2 steps on the sim, ~40 s
def test_every_family_runs_through_each_profile(tmp_path: Path) -> None:
    out = run_python(
        f"""
        import json
        from pathlib import Path
        from tests.helpers import TINY, compose_config, train_records
        from portatrain.accelerators.sim import counters, op_profiles
        from portatrain.trainer import Trainer

        base = [o for o in TINY if not o.startswith("device=")] + [
            "device=sim", "audit.runtime=true", "checkpoint.enabled=false", "trainer.steps=2", "trainer.log_every=1"]
        res = {{}}
        for family in {FAMILIES!r}:
            for profile in (None, "tpu", "neuron"):
                counters.set_profile(op_profiles.load(profile) if profile else None)
                run_dir = Path({str(tmp_path)!r}) / f"{{family}}-{{profile}}"
                trainer = Trainer(compose_config(base + [f"model={{family}}_debug"], run_dir))
                try:
                    trainer.fit()
                finally:
                    trainer.close()
                summary = trainer.runtime_audit.summary()
                res[f"{{family}}/{{profile}}"] = {{
                    "losses": [r["loss"] for r in train_records(run_dir)],
                    "ops": summary["ops"], "profile": summary["profile"],
                    "fallbacks": {{k.removeprefix("fallback:"): n for k, n in summary["offences"].items()
                                   if k.startswith("fallback:")}},
                    "offences": sorted(k for k in summary["offences"] if not k.startswith("fallback:")),
                }}
        print(json.dumps(res))
        """,
        env={"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )
    res = json.loads(out.strip().splitlines()[-1])
    for family in FAMILIES:
        plain = res[f"{family}/None"]
        assert len(plain["ops"]) > 30 and plain["fallbacks"] == {} and plain["profile"] is None, family
        for name in ("tpu", "neuron"):
            run = res[f"{family}/{name}"]
            assert run["profile"] == name and run["offences"] == [], (family, name)
            # The fallbacks really taken are the ones the profile judges from the run's own census.
            assert run["fallbacks"] == op_profiles.load(name).fallbacks(run["ops"]), (family, name)
            # Through the CPU fallback or not, the same numbers.
            assert run["losses"] == pytest.approx(plain["losses"], rel=1e-6), (family, name)
    print(json.dumps({k: v["fallbacks"] for k, v in res.items()}))  # the docs' table (pytest -s)


@pytest.mark.slow  # one fresh process on the sim: a run, a report (2 runtime audits + bench), parity: ~50 s
def test_a_planted_unsupported_op_is_named_by_the_runtime_audit_and_the_report(tmp_path: Path) -> None:
    out = run_python(
        f"""
        import json
        from pathlib import Path
        import torch
        from tests.helpers import TINY, compose_config, train_records
        from portatrain.parity import run_parity
        from portatrain.report import build_report, render_markdown
        from portatrain.trainer import Trainer

        class Planted(Trainer):
            def __init__(self, cfg):
                super().__init__(cfg)
                self.model.norm.register_forward_hook(self.plant)

            @staticmethod
            def plant(module, args, output):
                return torch.copysign(output, output)  # planted: no TPU or XLA kernel for it

        base = [o for o in TINY if not o.startswith("device=")] + [
            "device=sim", "model=llama3_debug", "checkpoint.enabled=false", "report.steps=2",
            "report.parity=false", "report.bench_steps=1", "report.bench_warmup_steps=0"]
        root = Path({str(tmp_path)!r})
        trainer = Planted(compose_config(base + ["audit.runtime=true", "trainer.steps=2"], root / "train"))
        try:
            trainer.fit()
        finally:
            trainer.close()
        document = build_report(compose_config(base, root / "report"), trainer_cls=Planted, progress=lambda m: None)
        parity = run_parity(compose_config(base, root / "parity"), 2, trainer_cls=Planted)
        print(json.dumps({{"records": train_records(root / "train"), "document": document,
                          "markdown": render_markdown(document), "parity": parity.format(),
                          "parity_ok": parity.ok, "parity_fallbacks": parity.fallbacks}}))
        """,
        env={"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "SIM_OP_PROFILE": "tpu"},
    )
    res = json.loads(out.strip().splitlines()[-1])
    for record in res["records"]:
        planted = {k: n for k, n in record["audit_offences"].items() if "copysign" in k}
        assert planted and record["audit_cpu_fallbacks"] == sum(planted.values()), record
        assert all(record["audit_first"][k].endswith("in plant") for k in planted if "backward" not in k)
    document = res["document"]
    item = {i["id"]: i for i in document["items"]}["2.2"]
    assert (
        item["status"] == FAIL and "aten::copysign.out" in item["evidence"] and "in plant" in item["evidence"]
    )
    assert document["runtime"]["profile"] == "tpu"
    assert "aten::copysign.out" in document["op_coverage"]["tpu"]["fallbacks"]
    assert "## Operator coverage by profile" in res["markdown"] and "`aten::copysign.out`" in res["markdown"]
    assert "## Plan on sim" in res["markdown"]
    # Parity holds through the fallback, and says which operators took it.
    assert res["parity_ok"] and set(res["parity_fallbacks"]) >= {"aten::copysign.out"}
    assert "CPU fallbacks on sim under op profile tpu: aten::copysign.out x" in res["parity"]
