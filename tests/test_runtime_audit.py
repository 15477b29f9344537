"""The runtime audit (``audit.runtime``, ``audit.nonfinite``; ``portatrain.audit.runtime``).

The sim checks run in one fresh process (installing the sim device is process-global): the
Trainer's own loop must show zero host syncs, fallbacks and mixed-device ops between logging
steps, eager and compiled; a planted ``.item()`` and ops marked unsupported must be counted and
located. The CPU checks run in-process: null (not 0) where nothing measures, graph breaks from
dynamo, and the non-finite hooks naming the module, the tensor and the step.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from portatrain.audit.runtime import NonFiniteValueError, RuntimeAudit, first_location
from portatrain.config import RuntimeAuditConfig
from portatrain.errors import ConfigError
from portatrain.trainer import Trainer
from portatrain.validate import validate
from tests.helpers import ROOT, TINY, compose_config, fit, launch_env, torchrun_command, train_records
from tests.test_sim import run_python

AUDIT = ["audit.runtime=true", "checkpoint.enabled=false", "trainer.steps=6", "trainer.log_every=3"]


@pytest.mark.slow  # one fresh process, four short runs on the sim device (~50 s on 2 loaded cores)
def test_sim_trainer_loop_has_no_sync_or_fallback_between_logging_steps(tmp_path: Path) -> None:
    out = run_python(
        f"""
        import json
        from pathlib import Path
        from tests.helpers import TINY, compose_config, train_records
        from portatrain.accelerators.sim import counters
        from portatrain.trainer import Trainer

        base = [o for o in TINY if not o.startswith("device=")] + ["device=sim"] + {AUDIT!r}
        root = Path({str(tmp_path)!r})

        class Planted(Trainer):
            def compute_loss(self, logits, batch):
                loss = super().compute_loss(logits, batch)
                if loss.item() > 1e9:  # planted: a host sync every micro-batch
                    print("never")
                return loss

        def run(name, extra=(), cls=Trainer):
            trainer = cls(compose_config(base + list(extra), root / name))
            try:
                trainer.fit()
            finally:
                trainer.close()
            keys = ("audit_steps", "audit_host_syncs", "audit_cpu_fallbacks", "audit_mixed_device",
                    "audit_graph_breaks", "audit_recompiles", "audit_offences", "audit_first")
            return [{{k: r[k] for k in keys}} for r in train_records(root / name)]

        res = {{"eager": run("eager")}}
        res["compiled"] = run("compiled", ["compile.enabled=true", "compile.warmup=true"])
        # The checks' own syncs are not the step's: nonfinite mode still shows zero.
        res["nonfinite"] = run("nonfinite", ["audit.nonfinite=true"])
        # Evaluation inside a window (step 2 and 4 of 3-step windows) syncs on purpose: left out.
        res["eval"] = run("eval", ["trainer.eval_every=2", "trainer.eval_batches=2"])
        counters.mark_unsupported(["aten::rsqrt"])
        res["planted"] = run("planted", cls=Planted)
        # A CPU run in a process that has the sim installed: the sim's counters do not speak for it.
        base = [o for o in TINY if not o.startswith("device=")] + ["device=cpu"] + {AUDIT!r}
        res["cpu"] = run("cpu")
        print(json.dumps(res))
        """,
        env={"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )
    res = json.loads(out.strip().splitlines()[-1])
    clean = {
        "audit_steps": 3,
        "audit_host_syncs": 0,
        "audit_cpu_fallbacks": 0,
        "audit_mixed_device": 0,
        "audit_graph_breaks": 0,
        "audit_recompiles": 0,
        "audit_offences": {},
        "audit_first": {},
    }
    for mode in ("eager", "compiled", "nonfinite", "eval"):
        assert res[mode] == [clean, clean], mode  # two logged windows of 3 steps, both clean
    assert [w["audit_host_syncs"] for w in res["cpu"]] == [None, None]
    for window in res["planted"]:
        assert window["audit_steps"] == 3
        assert window["audit_host_syncs"] == 3  # one .item() per step, nothing from the loop itself
        assert window["audit_offences"]["sync:item"] == 3
        assert window["audit_first"]["sync:item"].endswith("in compute_loss")
        assert "sim_check_" in window["audit_first"]["sync:item"]  # the test's own file
        assert window["audit_cpu_fallbacks"] > 0
        assert set(window["audit_offences"]) == {"sync:item", "fallback:aten::rsqrt.out"}
        assert "kernels/reference.py" in window["audit_first"]["fallback:aten::rsqrt.out"]


def test_cpu_records_null_where_nothing_measures(tmp_path: Path) -> None:
    fit(AUDIT, tmp_path / "audit")
    records = train_records(tmp_path / "audit")
    assert [r["step"] for r in records] == [3, 6]
    for r in records:
        assert r["audit_steps"] == 3
        # The CPU has no sync counter and nothing to fall back to: null, never an unmeasured 0.
        assert r["audit_host_syncs"] is None and r["audit_cpu_fallbacks"] is None
        assert r["audit_mixed_device"] is None
        assert r["audit_graph_breaks"] == 0 and r["audit_recompiles"] == 0
    fit(["checkpoint.enabled=false"], tmp_path / "plain")  # off by default: no audit keys at all
    assert not [k for r in train_records(tmp_path / "plain") for k in r if k.startswith("audit")]


class _Adapter:
    """The two adapter calls the audit makes, with a vendor-style fallback report."""

    device_type = "fake"

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}

    def take_fallback_report(self) -> dict[str, int] | None:
        report, self.pending = self.pending, {}
        return report

    def describe(self) -> str:
        return "fake:0"


def test_vendor_fallback_report_and_graph_breaks_are_counted_per_window() -> None:
    adapter = _Adapter()
    audit = RuntimeAudit(RuntimeAuditConfig(runtime=True), adapter, torch.nn.Linear(2, 2))  # type: ignore[arg-type]

    def breaks(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        print("a graph break")  # dynamo cannot trace print
        return y + 1

    compiled = torch.compile(breaks, backend="eager")
    adapter.pending = {"stale": 9}  # before the window: forgotten
    audit.step_begin(1)
    compiled(torch.ones(3))
    adapter.pending = {"aten::_foo": 2}
    first = audit.window_end()
    assert first["audit_cpu_fallbacks"] == 2 and first["audit_offences"]["fallback:aten::_foo"] == 2
    assert first["audit_host_syncs"] is None  # no sync counter off the sim
    assert first["audit_graph_breaks"] >= 1 and first["audit_graphs"] >= 2
    assert any(k.startswith("graph_break:") for k in first["audit_offences"])
    audit.step_begin(2)
    compiled(torch.ones(3))  # cached: nothing new
    compiled(torch.ones(5))  # a new shape: the guard fails, dynamo recompiles
    second = audit.window_end()
    assert second["audit_cpu_fallbacks"] == 0 and second["audit_recompiles"] >= 1
    # Evaluation inside a window: what it compiles and falls back on is left out, the step's is kept.
    audit.step_begin(3)
    adapter.pending = {"aten::_step_op": 1}
    with audit.paused():
        torch.compile(lambda x: x.sin() + 1, backend="eager")(torch.ones(2))
        adapter.pending = {"aten::_eval_op": 5}
    third = audit.window_end()
    assert third["audit_offences"] == {"fallback:aten::_step_op": 1}
    assert third["audit_graphs"] == 0 and third["audit_recompiles"] == 0
    summary = audit.summary()
    assert summary["windows"] == 3 and summary["steps"] == 3 and summary["cpu_fallbacks"] == 3
    assert summary["host_syncs"] is None


def test_first_location_skips_torch_frames() -> None:
    stack = (
        '  File "/work/x/train.py", line 12, in step\n    loss.item()\n'
        f'  File "{Path(torch.__file__).parent}/_tensor.py", line 40, in item\n'
    )
    assert first_location(stack) == "/work/x/train.py:12 in step"


class _NaNMlp(Trainer):
    """Layer 1's MLP returns NaN (a planted numerical bug inside one module)."""

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        model = super().parallelize(model)
        mlp = model.layers["1"].mlp
        forward = mlp.forward
        mlp.forward = lambda x: forward(x) * float("nan")
        return model


class _NaNBetweenModules(Trainer):
    """Code between modules (here: a pre-hook standing in for the block's own arithmetic) makes NaN."""

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        model = super().parallelize(model)
        model.layers["0"].post_attention_layernorm.register_forward_pre_hook(
            lambda module, args: (args[0] / 0.0 * 0.0,)
        )
        return model


class _Inf(torch.autograd.Function):
    """Identity forward, NaN backward: a gradient that goes bad while every output is finite."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad * float("nan")


class _NaNGradient(Trainer):
    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        model = super().parallelize(model)
        model.layers["1"].mlp.register_forward_hook(lambda module, args, out: _Inf.apply(out))
        return model


@pytest.mark.parametrize(
    ("trainer_cls", "expected"),
    [
        (_NaNMlp, ["step 1, training forward", "module 'layers.1.mlp' (", "so this module made it"]),
        (
            _NaNBetweenModules,
            ["module 'layers.0.post_attention_layernorm'", "already non-finite", "forward of 'layers.0'"],
        ),
        (_NaNGradient, ["step 1, backward: the gradient of parameter 'layers.", "NaN"]),
    ],
)
def test_nonfinite_names_the_step_module_and_tensor(
    tmp_path: Path, trainer_cls: type, expected: list[str]
) -> None:
    with pytest.raises(NonFiniteValueError) as caught:
        fit(["audit.nonfinite=true", "checkpoint.enabled=false"], tmp_path / "run", trainer_cls)
    message = str(caught.value)
    for fragment in expected:
        assert fragment in message, message
    assert "shape [" in message and "first at index (" in message


def test_nonfinite_with_compile_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"audit.nonfinite=true .* set compile.enabled=false"):
        validate(compose_config(["audit.nonfinite=true", "compile.enabled=true"]))


_NAN_ON_RANK_1 = """
import os

import torch

from portatrain.cli import main
from portatrain.trainer import Trainer


class NaNOnRank1(Trainer):
    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        model = super().parallelize(model)
        if self.dist.rank == 1:
            mlp = model.layers["1"].mlp
            forward = mlp.forward
            mlp.forward = lambda x: forward(x) * float("nan")
        return model


main(trainer_cls=NaNOnRank1)
"""


@pytest.mark.slow  # two processes under torchrun (~30 s on 2 loaded cores)
def test_nonfinite_on_one_rank_stops_every_rank_with_one_message(tmp_path: Path) -> None:
    script = tmp_path / "nan_on_rank_1.py"
    script.write_text(_NAN_ON_RANK_1)
    args = [*TINY, "parallel.dp_shard=2", "audit.nonfinite=true", "checkpoint.enabled=false"]
    out = subprocess.run(
        [*torchrun_command(2), str(script), *args, f"run_dir={tmp_path / 'run'}"],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    errors = [line for line in out.stderr.splitlines() if "error: rank 1: audit.nonfinite: step 1" in line]
    assert out.returncode != 0 and len(errors) == 1, out.stderr[-3000:]
    assert "module 'layers.1.mlp'" in errors[0]
