"""``portatrain audit``: every rule on its fixture (exact rule ids and lines), suppressions, the
project config, exit codes, the JSON and SARIF documents, the examples, and portatrain's own code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from portatrain.audit import RULES, AuditConfig, audit_paths, scan_source
from portatrain.audit.cli import main
from portatrain.audit.config import AuditConfigError, find_config, load_config
from tests.helpers import launch_env, python

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "audit"

# (rule, line) of every finding in each fixture; each fixture ends with clean negatives.
EXPECTED: dict[str, set[tuple[str, int]]] = {
    "device_placement.py": {
        ("cuda-device-branch", 13),  # device = "cuda" if torch.cuda.is_available() else "cpu"
        ("cuda-set-device", 14),
        ("cuda-call", 15),
        ("ddp-device-ids", 16),
        ("cuda-device-string", 17),  # device="cuda"
        ("cuda-device-string", 18),  # .to(f"cuda:{local_rank}")
        ("cuda-device-string", 19),  # torch.device("cuda", local_rank)
        ("cuda-device-string", 20),  # .to("cuda:0")
        ("cuda-device-string", 21),  # "cuda:" + str(local_rank)
        ("cuda-device-string", 22),  # DEVICE = "cuda"
    },
    "cuda_apis.py": {
        ("cuda-backend-flag", 11),  # torch.backends.cuda.matmul.allow_tf32
        ("cuda-backend-flag", 12),  # torch.backends.cudnn.benchmark
        ("cuda-api", 13),  # torch.cuda.Event
        ("cuda-api", 14),
        ("cuda-api", 18),  # torch.cuda.synchronize
        ("cuda-api", 19),  # torch.cuda.max_memory_allocated
        ("cuda-api", 20),  # torch.cuda.manual_seed_all
        ("cuda-amp", 21),  # torch.cuda.amp.GradScaler
        ("cuda-amp", 22),  # torch.cuda.amp.autocast
        ("pin-memory-cuda", 24),  # pin_memory=torch.cuda.is_available()
        ("pin-memory-cuda", 25),  # pin_memory=True
        ("nccl-backend", 26),  # backend="nccl"
        ("nccl-backend", 27),  # dist.Backend.NCCL
    },
    "kernels.py": {
        ("cuda-library", 3),  # apex
        ("cuda-library", 4),  # bitsandbytes
        ("cuda-library", 5),  # triton
        ("cuda-library", 6),  # triton.language
        ("cuda-library", 7),  # flash_attn
        ("cuda-extension", 8),  # torch.utils.cpp_extension
        ("cuda-library", 10),  # xformers
        ("cuda-extension", 12),  # "csrc/rope_kernel.cu"
        ("cuda-library", 13),  # attn_implementation="flash_attention_2"
    },
    "attention.py": {
        ("manual-attention", 15),  # q @ k.transpose(-2, -1) ... F.softmax(att)
        ("manual-attention", 21),  # torch.matmul(q, k.transpose(2, 3)) ... .softmax()
        ("manual-attention", 26),  # torch.einsum("bhqd,bhkd->bhqk")
        ("sdpa-backend-pin", 31),  # sdpa_kernel(SDPBackend.FLASH_ATTENTION)
        ("sdpa-backend-pin", 33),  # torch.backends.cuda.sdp_kernel(enable_flash=True)
    },
    "host_syncs.py": {
        ("host-sync", 15),  # loss.item()
        ("host-sync", 16),  # .tolist()
        ("host-sync", 17),  # .cpu()
        ("host-sync", 18),  # print(loss)
        ("host-sync", 19),  # f"{loss:.3f}"
        ("host-sync", 20),  # float(tensor)
        ("tensor-control-flow", 21),  # if loss < best
        ("tensor-control-flow", 23),  # if torch.isnan(loss)
        ("data-dependent-shape", 25),  # logits[y != -100]
        ("data-dependent-shape", 26),  # y.nonzero()
        ("host-sync", 39),  # .item() in a step function
        ("tensor-control-flow", 47),  # a loop calling train_step: if grad_norm.isinf().any()
        ("host-sync", 56),  # .item() once per evaluation batch (the progress print is left alone)
        ("tensor-control-flow", 68),  # while loss > target, in a training while-loop
    },
    "dynamic_shapes.py": {
        ("pad-to-batch-max", 12),  # max(len(ids) for ids in batch) -> torch.full
        ("pad-to-batch-max", 20),  # max(map(len, batch)) -> [PAD] * (longest - len)
        ("pad-sequence-unbucketed", 25),
        ("pad-to-batch-max", 29),  # tokenizer(..., padding=True)
        ("pad-to-batch-max", 33),  # max(s.size(0)) -> F.pad
    },
    "checkpoints.py": {
        ("torch-load-implicit", 10),
        ("torch-load-unsafe", 11),
        ("pickle-dump", 13),
        ("pickle-load", 15),
        ("pickle-load", 35),  # a pickle.Unpickler subclass without an allow-listing find_class
    },
    "aliases.py": {
        ("cuda-api", 11),  # th.cuda.synchronize()
        ("cuda-api", 12),  # cuda.empty_cache() (from torch import cuda)
        ("cuda-api", 13),  # sync() (from torch.cuda import synchronize as sync)
        ("cuda-backend-flag", 14),  # cudnn.deterministic (from torch.backends import cudnn)
        ("cuda-amp", 15),  # GradScaler() (from torch.cuda.amp import GradScaler)
        ("cuda-amp", 16),  # autocast()
        ("cuda-device-string", 18),  # th.device("cuda")
    },
    "suppressions.py": {("cuda-api", 9)},  # the comment names another rule: still reported
}


def _found(path: Path) -> set[tuple[str, int]]:
    return {(f.rule, f.line) for f in audit_paths([path]).findings}


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_fixture_findings_are_exact(fixture: str) -> None:
    assert _found(FIXTURES / fixture) == EXPECTED[fixture]


def test_every_rule_has_a_fixture() -> None:
    from tests.test_audit_recall import EXPECTED as RECALL_EXPECTED  # the rules about CUDA-first code

    tables = [*EXPECTED.values(), *RECALL_EXPECTED.values()]
    covered = {rule for expected in tables for rule, _ in expected} | {"syntax-error"}
    assert covered == set(RULES)


def test_findings_carry_location_severity_and_fix() -> None:
    findings = audit_paths([FIXTURES / "device_placement.py"]).findings
    call = next(f for f in findings if f.rule == "cuda-call")
    # `    model = model.cuda()`: the column points at `cuda`, 1-based.
    assert (call.line, call.column, call.severity) == (15, 19, "error")
    assert call.path.endswith("tests/fixtures/audit/device_placement.py")
    assert "NVIDIA" in call.message and ".to(device)" in call.replacement
    sync = next(f for f in audit_paths([FIXTURES / "aliases.py"]).findings if f.line == 11)
    assert sync.replacement == "`torch.accelerator.synchronize()`"


def test_columns_count_characters_not_bytes() -> None:
    (finding,) = scan_source('import torch\nlabel = "é"; x = torch.zeros(1).cuda()\n')
    assert (finding.line, finding.column) == (2, 33)


def test_host_syncs_only_in_the_training_step() -> None:
    source = """
import torch

def evaluate(model, loader):
    for x in loader:
        print(model(x).item())

def fit(model, optimizer, loader):
    for step, x in enumerate(loader):
        loss = model(x)
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            print(loss.item())
        else:
            print(loss.item())
"""
    assert [(f.rule, f.line) for f in scan_source(source)] == [("host-sync", 16)]


def test_module_level_training_loop() -> None:
    source = """
import torch
model, optimizer = torch.nn.Linear(2, 1), None
while True:
    loss = model(torch.randn(4, 2)).sum()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if step % 10 == 0:
        print(loss.item())
"""
    assert [(f.rule, f.line) for f in scan_source(source)] == [("host-sync", 8)]


def test_syntax_error_is_a_finding() -> None:
    (finding,) = scan_source("def broken(:\n", "bad.py")
    assert (finding.rule, finding.severity, finding.line) == ("syntax-error", "error", 1)


def test_inline_suppressions_keep_their_justification() -> None:
    result = audit_paths([FIXTURES / "suppressions.py"])
    suppressed = {(f.rule, f.line): f.justification for f in result.suppressed}
    assert suppressed == {
        ("cuda-api", 7): "benchmark helper, CUDA-only by design",
        ("cuda-call", 8): "",  # a bare `# portatrain: ignore`
        ("cuda-device-string", 12): "multi-line call, comment on its first line",
    }


# -- config -----------------------------------------------------------------------------------------
def _project(tmp_path: Path, config: str, name: str = "pyproject.toml") -> Path:
    (tmp_path / name).write_text(config)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text((FIXTURES / "cuda_apis.py").read_text())
    (tmp_path / "vendor").mkdir()
    (tmp_path / "vendor" / "cuda_adapter.py").write_text("import torch\ntorch.cuda.synchronize()\n")
    return tmp_path


def test_pyproject_config_disables_overrides_and_excludes(tmp_path: Path) -> None:
    root = _project(
        tmp_path,
        """
[tool.portatrain.audit]
disable = ["cuda-amp"]
exclude = ["vendor"]
fail-on = "warning"

[tool.portatrain.audit.severity]
pin-memory-cuda = "error"
nccl-backend = "info"
""",
    )
    config = load_config(find_config(root / "pkg"))
    result = audit_paths([root], config)
    assert [Path(f).relative_to(root.resolve()).as_posix() for f in result.files] == ["pkg/train.py"]
    rules = {f.rule for f in result.findings}
    assert "cuda-amp" not in rules and "cuda-api" in rules
    severities = {f.rule: f.severity for f in result.findings}
    assert severities["pin-memory-cuda"] == "error" and severities["nccl-backend"] == "info"
    assert config.fail_on == "warning"


def test_dedicated_config_file_wins_and_cli_reads_fail_on(tmp_path: Path, capsys) -> None:
    root = _project(tmp_path, '[tool.portatrain.audit]\nfail-on = "never"\n')
    (root / ".portatrain-audit.toml").write_text('fail-on = "info"\ndisable = ["cuda-api"]\n')
    assert find_config(root / "pkg" / "train.py") == root / ".portatrain-audit.toml"
    assert main([str(root / "pkg"), "--format", "json"]) == 1  # fail-on=info from the file
    document = json.loads(capsys.readouterr().out)
    assert document["fail_on"] == "info" and document["config"].endswith(".portatrain-audit.toml")
    assert "cuda-api" not in document["summary"]["by_rule"]
    assert main([str(root / "pkg"), "--no-config", "--fail-on", "never"]) == 0


def test_bad_config_reports_every_problem(tmp_path: Path, capsys) -> None:
    root = _project(
        tmp_path,
        '[tool.portatrain.audit]\ndisable = ["cuda-cal"]\nseverity = { host-sync = "fatal" }\nfail_on = "x"\n',
    )
    with pytest.raises(AuditConfigError) as info:
        load_config(root / "pyproject.toml")
    message = str(info.value)
    assert "'cuda-cal'" in message and "'fatal'" in message and "unknown key 'fail_on'" in message
    assert main([str(root / "pkg")]) == 2
    assert "portatrain audit: error:" in capsys.readouterr().err


# -- command line -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("fail_on", "status"), [("error", 0), ("warning", 1), ("info", 1), ("never", 0)])
def test_fail_on_sets_the_exit_code(fail_on: str, status: int, capsys) -> None:
    # dynamic_shapes.py has warnings only.
    assert main([str(FIXTURES / "dynamic_shapes.py"), "--no-config", f"--fail-on={fail_on}"]) == status
    assert "5 findings (0 error, 5 warning, 0 info)" in capsys.readouterr().out


def test_errors_fail_by_default_and_missing_paths_are_named(capsys) -> None:
    assert main([str(FIXTURES / "kernels.py"), "--no-config"]) == 1
    assert main(["no/such/dir", "--no-config"]) == 2
    assert "no such file or directory: no/such/dir" in capsys.readouterr().err


def test_list_rules_names_every_rule(capsys) -> None:
    assert main(["--list-rules"]) == 0
    text = capsys.readouterr().out
    assert all(rule_id in text for rule_id in RULES)
    assert main(["--list-rules", "--format", "json"]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == list(RULES)


def test_json_document_is_stable(capsys) -> None:
    assert (
        main([str(FIXTURES / "checkpoints.py"), str(FIXTURES / "suppressions.py"), "--format", "json"]) == 1
    )
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == "portatrain.audit/1"
    assert set(document) == {
        "schema", "tool", "paths", "files", "config", "fail_on", "failed", "summary", "findings",
        "suppressed", "rules",
    }  # fmt: skip
    assert document["summary"] == {
        "error": 4,
        "warning": 2,
        "info": 0,
        "suppressed": 3,
        "by_rule": {
            "cuda-api": 1,
            "pickle-dump": 1,
            "pickle-load": 2,
            "torch-load-implicit": 1,
            "torch-load-unsafe": 1,
        },
        "by_level": {"0": 5, "1": 1},
    }
    first = document["findings"][0]
    assert set(first) == {
        "path", "line", "column", "end_line", "end_column", "rule", "severity", "level", "category",
        "message", "replacement",
    }  # fmt: skip
    assert (first["rule"], first["line"], first["column"]) == ("torch-load-implicit", 10, 13)
    assert document["suppressed"][0]["justification"] == "benchmark helper, CUDA-only by design"
    assert set(document["rules"]) == set(RULES)


def test_sarif_has_the_required_fields(capsys) -> None:
    assert main([str(FIXTURES / "attention.py"), str(FIXTURES / "suppressions.py"), "--format", "sarif"]) == 1
    sarif = json.loads(capsys.readouterr().out)
    assert sarif["version"] == "2.1.0" and sarif["$schema"].endswith("sarif-2.1.0.json")
    (run,) = sarif["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "portatrain-audit"
    rule_ids = [rule["id"] for rule in driver["rules"]]
    assert rule_ids == list(RULES)
    for rule in driver["rules"]:
        assert rule["shortDescription"]["text"] and rule["help"]["text"]
        assert rule["defaultConfiguration"]["level"] in ("error", "warning", "note")
    assert len(run["results"]) == 5 + 1 + 3  # attention.py, suppressions.py active + suppressed
    for result in run["results"]:
        assert rule_ids[result["ruleIndex"]] == result["ruleId"]
        assert result["level"] in ("error", "warning", "note") and result["message"]["text"]
        region = result["locations"][0]["physicalLocation"]["region"]
        assert region["startLine"] >= 1 and region["startColumn"] >= 1
    assert sum("suppressions" in r for r in run["results"]) == 3


def test_portatrain_audit_command_is_wired() -> None:
    from tests.conftest import run_cli

    clean = run_cli(["audit", "--fail-on", "warning", "examples/ported_train.py"], cwd=ROOT)
    assert clean.returncode == 0, clean.stderr
    assert "0 findings" in clean.stdout
    flagged = run_cli(["audit", "examples/cuda_first_train.py", "--format", "json"], cwd=ROOT)
    assert flagged.returncode == 1, flagged.stderr
    assert json.loads(flagged.stdout)["summary"]["error"] == 14


def test_module_entry_point_runs(tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    env = launch_env()
    command = python("-m", "portatrain.audit", str(FIXTURES / "checkpoints.py"), "--format", "json")
    proc = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    assert json.loads(out.read_text())["summary"]["error"] == 3


# -- the worked example and portatrain itself -------------------------------------------------------
def test_cuda_first_example_is_flagged_and_its_port_is_clean() -> None:
    before = audit_paths([ROOT / "examples" / "cuda_first_train.py"])
    assert {f.rule for f in before.findings} == {
        "cuda-library",
        "pad-to-batch-max",
        "manual-attention",
        "nccl-backend",
        "cuda-set-device",
        "cuda-device-string",
        "cuda-device-branch",
        "cuda-api",
        "cuda-backend-flag",
        "pin-memory-cuda",
        "cuda-call",
        "ddp-device-ids",
        "cuda-amp",
        "torch-load-implicit",
        "host-sync",
        "tensor-control-flow",
        "data-dependent-shape",
        "pickle-dump",
    }
    assert before.fails("error")
    after = audit_paths([ROOT / "examples" / "ported_train.py"])
    assert after.findings == [] and after.suppressed == []


def test_portatrain_source_audits_clean() -> None:
    """``portatrain audit src`` passes at the default fail-on level. The CUDA and simulated-device
    adapters are excluded by ``[tool.portatrain.audit]`` in pyproject.toml: device-specific code
    belongs there, and only there."""
    config = load_config(ROOT / "pyproject.toml")
    result = audit_paths([ROOT / "src"], config)
    assert not result.fails("error"), "\n".join(
        f"{f.path}:{f.line}:{f.column}: {f.rule} {f.message}" for f in result.findings
    )
    assert len(result.files) > 20  # the walk really covered the package
    assert not any("accelerators/cuda.py" in f for f in result.files)


def test_named_files_are_audited_even_when_excluded(tmp_path: Path) -> None:
    root = _project(tmp_path, '[tool.portatrain.audit]\nexclude = ["vendor"]\n')
    config = load_config(root / "pyproject.toml")
    assert config.excludes(root / "vendor" / "cuda_adapter.py") and not AuditConfig().excludes(
        root / "vendor"
    )
    assert [f.rule for f in audit_paths([root / "vendor" / "cuda_adapter.py"], config).findings] == [
        "cuda-api"
    ]


def test_ported_example_trains_with_label_smoothing(tmp_path: Path, monkeypatch) -> None:
    """The port runs as a Trainer subclass: its loss is the label-smoothed sum, it tracks the best
    evaluation loss, and training through it works end to end."""
    import importlib.util

    import torch
    import torch.nn.functional as F

    from tests.conftest import TINY, compose_config

    spec = importlib.util.spec_from_file_location("ported_train", ROOT / "examples" / "ported_train.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ported_train", module)  # as `python examples/...` registers __main__
    spec.loader.exec_module(module)
    trainer_cls = module.LabelSmoothingTrainer

    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 7, 8]])
    loss = trainer_cls.compute_loss(trainer_cls.__new__(trainer_cls), logits, {"labels": labels})
    smoothed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1, reduction="sum")
    plain = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    assert torch.allclose(loss, smoothed) and not torch.allclose(loss, plain)

    class Recording(trainer_cls):
        evals: list[float] = []

        def on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
            self.evals.append(metrics["eval_loss"])
            super().on_eval_end(step, metrics)

    cfg = compose_config([*TINY, "trainer.eval_every=2", "data.eval_fraction=0.2"], run_dir=tmp_path / "run")
    trainer = Recording(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert len(trainer.evals) == 2 and trainer.best_eval_loss == min(trainer.evals)

    # The report audits the code in use: the subclass's file (and this test's, where Recording
    # lives), never portatrain's own Trainer.
    from portatrain.audit.sources import trainer_sources

    assert trainer_sources(Recording) == [Path(__file__), ROOT / "examples" / "ported_train.py"]
    assert trainer_sources(None) == []
