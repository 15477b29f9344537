"""The simulated accelerator (``device=sim``): device semantics, memory, counters, training parity.

Installing the sim device renames torch's PrivateUse1 backend for the whole process, which cannot
be undone, so every check runs in a fresh subprocess, a fork of the test process's fork server
(``tests/fork_server.py``: torch is imported already; each start costs the extension load). The
first test in a fresh CI run also pays the C++ build, about 47 CPU-s, cached afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.helpers import python

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, env: dict[str, str] | None = None, timeout: int = 600) -> str:
    """Run ``code`` in a fresh process (a fork of the fork server: the sim settings are read when the
    device is installed, not at import); return stdout, failing the test with stderr on error."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    # A file, not -c: the counters' first-occurrence stacks quote source lines.
    with tempfile.NamedTemporaryFile("w", suffix=".py", prefix="sim_check_", delete=False) as script:
        script.write(textwrap.dedent(code))
    try:
        proc = subprocess.run(
            python(script.name), capture_output=True, text=True, env=full_env, timeout=timeout
        )
    finally:
        os.unlink(script.name)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    )
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout


def test_import_portatrain_leaves_privateuse1_alone() -> None:
    out = run_python(
        """
        import sys, torch
        import portatrain, portatrain.accelerators, portatrain.cli
        assert "sim" in portatrain.accelerators.ACCELERATORS
        assert "sim" not in portatrain.accelerators.AUTO_ORDER
        loaded = [m for m in sys.modules if m.startswith("portatrain.accelerators.sim.") and m != "portatrain.accelerators.sim.adapter"]
        print(loaded, torch._C._get_privateuse1_backend_name())
        """,
        # A new interpreter: a fork of the server would already hold what the server imported.
        env={"PORTATRAIN_TEST_NO_FORK": "1"},
    )
    assert out.split() == ["[]", "privateuseone"]


def test_device_basics_views_rng_and_memory() -> None:
    out = run_python(
        """
        import json, torch
        from portatrain.accelerators.sim import runtime
        runtime.install()
        res = {}
        x = torch.arange(12.0).reshape(3, 4).to("sim")
        v = x[:, 1:3].t()                      # a view: writes through it land in x
        v.mul_(-1)
        res["view_write"] = x.cpu().tolist()
        res["views_share"] = v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        a, b = torch.randn(5, 7), torch.randn(7, 3)
        res["matmul"] = torch.equal((a.to("sim") @ b.to("sim")).cpu(), a @ b)
        out = torch.empty(0, device="sim")
        torch.add(torch.ones(6, device="sim"), 1, out=out)   # out= grows a 0-size tensor
        res["out_resize"] = out.cpu().tolist()
        # seeded device RNG draws what the CPU draws from the same seed
        torch.manual_seed(7); cpu = torch.randn(5)
        torch.manual_seed(7); sim = torch.randn(5, device="sim").cpu()
        res["rng_like_cpu"] = torch.equal(cpu, sim)
        state = torch.sim.get_rng_state()
        r1 = torch.rand(3, device="sim").cpu(); torch.sim.set_rng_state(state)
        res["rng_state_roundtrip"] = torch.equal(r1, torch.rand(3, device="sim").cpu())
        # memory statistics through the generic torch.accelerator API
        torch.accelerator.reset_peak_memory_stats(0)
        before = torch.accelerator.memory_allocated(0)
        big = torch.empty(1 << 20, device="sim")
        res["allocated_delta"] = torch.accelerator.memory_allocated(0) - before
        del big
        res["freed"] = torch.accelerator.memory_allocated(0) == before
        res["peak"] = torch.accelerator.max_memory_allocated(0) - before
        res["accelerator"] = str(torch.accelerator.current_accelerator())
        res["count"] = torch.accelerator.device_count()
        y = torch.ones(2, device="sim:1")
        res["device1"] = str((y + 1).device)
        # storage resize (what FSDP2 does to free and re-gather parameters)
        s = torch.ones(4, device="sim"); s.untyped_storage().resize_(0); s.untyped_storage().resize_(16)
        res["storage_resize"] = s.untyped_storage().nbytes()
        with torch.autocast("sim", dtype=torch.bfloat16):  # CUDA's autocast lists
            m = x @ x.t()
            res["autocast"] = [str(m.dtype), str(torch.log_softmax(m, -1).dtype)]
        print(json.dumps(res))
        """,
        env={"SIM_DEVICE_COUNT": "2"},
    )
    res = json.loads(out.strip().splitlines()[-1])
    assert res["view_write"] == [[0, -1, -2, 3], [4, -5, -6, 7], [8, -9, -10, 11]]
    assert res["views_share"] and res["matmul"] and res["rng_like_cpu"] and res["rng_state_roundtrip"]
    assert res["out_resize"] == [2.0] * 6
    assert res["allocated_delta"] == 4 << 20 and res["freed"] and res["peak"] == 4 << 20
    assert res["accelerator"] == "sim" and res["count"] == 2 and res["device1"] == "sim:1"
    assert res["storage_resize"] == 16
    assert res["autocast"] == ["torch.bfloat16", "torch.float32"]


def test_capacity_raises_out_of_memory_error() -> None:
    out = run_python(
        """
        import torch
        from portatrain.accelerators.sim import runtime
        runtime.install()
        keep = torch.empty(3 << 20, dtype=torch.uint8, device="sim")
        try:
            torch.empty(2 << 20, dtype=torch.uint8, device="sim")
        except torch.OutOfMemoryError as exc:
            print("OOM", str(exc).splitlines()[0])
        free, total = torch.accelerator.get_memory_info(0)
        print(free, total)
        """,
        env={"SIM_MEMORY_CAPACITY": "4MiB"},
    )
    oom, info = out.strip().splitlines()[-2:]
    assert oom.startswith("OOM sim out of memory on device 0. Tried to allocate 2.00 MiB; 3.00 MiB already")
    assert info.split() == [str(1 << 20), str(4 << 20)]


def test_counters_name_each_sync_kind_with_its_stack() -> None:
    out = run_python(
        """
        import json, torch
        from portatrain.accelerators.sim import runtime, counters
        runtime.install()
        x = torch.randn(8, device="sim")
        counters.reset()
        x.sum().item()                    # line 7
        x.cpu()
        torch.nonzero(x > 0)
        x[x > 0]
        torch.equal(x, x)
        torch.sim.synchronize()
        try:
            x + torch.ones(8)             # torch itself rejects mixed devices here, as on a real device
        except RuntimeError as exc:
            mixed_error = "same device" in str(exc)
        x + torch.tensor(1.0)             # a 0-dim CPU scalar is fine, as on CUDA
        c = counters.take()
        print(json.dumps({"syncs": c.syncs, "mixed": c.mixed_device, "stack": c.first_stacks["sync:item"], "mixed_error": mixed_error,
                          "after_take": counters.snapshot().offences()}))
        """
    )
    res = json.loads(out.strip().splitlines()[-1])
    assert res["syncs"] == {
        "item": 1,
        "d2h": 1,
        "data_dependent:aten::nonzero": 2,
        "data_dependent:aten::index.Tensor_out[bool mask]": 1,
        "scalar_result:aten::equal": 1,
        "synchronize": 1,
    }
    assert res["mixed"] == {} and res["mixed_error"]
    assert "line 7" in res["stack"] and "x.sum().item()" in res["stack"]
    assert res["after_take"] == {}


def test_expect_no_sync_or_fallback_and_modes() -> None:
    out = run_python(
        """
        import torch
        from portatrain.accelerators.sim import runtime, counters
        runtime.install()
        x = torch.randn(8, device="sim", requires_grad=True)
        with counters.expect_no_sync_or_fallback() as seen:
            (x * 2).sin().sum().backward()
        print("clean", seen.offences(), seen.transfers)
        try:
            with counters.expect_no_sync_or_fallback():
                loss = (x * 2).sum()
                loss.item()
        except counters.SimOffenceError as exc:
            print("caught", "sync:item x1" in str(exc), "loss.item()" in str(exc))
        with counters.expect_no_sync_or_fallback(allow=("sync:item",)):
            x.sum().item()
        print("allowed")
        try:
            with counters.expect_no_sync_or_fallback(strict=True):
                x.detach().cpu()
                print("not reached")
        except RuntimeError as exc:
            print("strict", str(exc).startswith("[sim] sync:d2h"))
        counters.mark_unsupported(["aten::sin"], action="error")
        try:
            x.sin()
        except RuntimeError as exc:
            print("unsupported", "fallback:aten::sin" in str(exc))
        counters.mark_unsupported(["aten::sin"], action="count")
        counters.reset(); x.sin(); x.cos()
        print("fallbacks", counters.snapshot().fallbacks)
        counters.mark_unsupported([])
        counters.reset()
        with counters.paused():
            with counters.paused():
                x.sum().item()
            x.sum().item()                # still paused: the outer block has not ended
        x.sum().item()
        print("paused", counters.take().syncs)
        counters.set_mode("raise")
        try:
            x.sum().item()
        except RuntimeError as exc:
            print("mode-raise", "sync:item" in str(exc))
        """
    )
    lines = out.strip().splitlines()
    assert lines == [
        "clean {} {}",
        "caught True True",
        "allowed",
        "strict True",
        "unsupported True",
        "fallbacks {'aten::sin.out': 1}",  # structured ops arrive as .out
        "paused {'item': 1}",
        "mode-raise True",
    ]


def _losses(run_dir: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


# The debug recipe's model on a smaller slice of its corpus: each run takes seconds.
SMALL = [
    "data.num_documents=200",
    "data.seq_len=64",
    "data.batch_size=4",
    "trainer.steps=4",
    "trainer.log_every=2",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "trainer.dtype=float32",
    "checkpoint.enabled=false",
]


def _train(
    device: str, run_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> list[tuple[int, float, float]]:
    cmd = [*python("-m", "portatrain"), f"device={device}", *SMALL, f"run_dir={run_dir}", *extra]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "terminate called" not in proc.stderr
    return _losses(run_dir)


@pytest.fixture(scope="module")
def cpu_losses(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float, float]]:
    """The CPU run every sim run is compared with (fp32, same seed, same batches)."""
    losses = _train("cpu", tmp_path_factory.mktemp("cpu") / "run")
    assert [step for step, _, _ in losses] == [2, 4]
    return losses


def _assert_matches(got: list[tuple[int, float, float]], want: list[tuple[int, float, float]]) -> None:
    """Equal to fp32 rounding: the sim runs the CPU's kernels, but compiled graphs fuse differently."""
    assert [step for step, _, _ in got] == [step for step, _, _ in want]
    for (_, loss, norm), (_, loss_ref, norm_ref) in zip(got, want):
        assert loss == pytest.approx(loss_ref, abs=1e-5)
        assert norm == pytest.approx(norm_ref, rel=1e-5)


def test_debug_recipe_on_sim_matches_cpu(tmp_path: Path, cpu_losses: list) -> None:
    _assert_matches(_train("sim", tmp_path / "sim"), cpu_losses)


def test_compiled_blocks_on_sim_match_cpu(tmp_path: Path, cpu_losses: list) -> None:
    """torch.compile per block with the adapter's backend (aot_eager): graphs traced on the device."""
    _assert_matches(_train("sim", tmp_path / "sim", "compile.enabled=true"), cpu_losses)


def test_impersonation_presents_the_device_as_neuron() -> None:
    out = run_python(
        """
        import json, torch
        from portatrain.accelerators.sim import runtime, counters
        from portatrain.accelerators.sim.adapter import SimAccelerator
        acc = SimAccelerator()
        assert acc.device_type == "neuron" and acc.dist_backend == "cpu:gloo,neuron:simccl"
        acc.load()
        x = torch.ones(3, device="neuron")
        torch.accelerator.set_device_index(1)
        res = {
            "device": str((x * 2).device),
            "module": torch.neuron.device_count(),
            "accelerator": str(torch.accelerator.current_accelerator()),
            "current": torch.accelerator.current_device_index(),
            "allocated": torch.accelerator.memory_allocated(0),
            "is_neuron": x.is_neuron,
        }
        torch.accelerator.synchronize()
        res["counted"] = counters.snapshot().syncs
        try:
            runtime.install("tpu")
        except RuntimeError as exc:
            res["second_name"] = "one PrivateUse1 name per process" in str(exc)
        print(json.dumps(res))
        """,
        env={"PORTATRAIN_SIM_AS": "neuron", "SIM_DEVICE_COUNT": "2"},
    )
    res = json.loads(out.strip().splitlines()[-1])
    assert res == {
        "device": "neuron:0",
        "module": 2,
        "accelerator": "neuron",
        "current": 1,
        "allocated": 12,
        "is_neuron": True,
        "counted": {"synchronize": 1},
        "second_name": True,
    }


def test_tpu_adapter_trains_end_to_end_on_the_impersonating_sim(tmp_path: Path, cpu_losses: list) -> None:
    """A stand-in ``torch_tpu`` that installs the sim as ``tpu`` under the names TorchTPU registers:
    the unchanged TPU adapter (``device=tpu``) then trains, with the CPU's losses."""
    standin = tmp_path / "standin" / "torch_tpu"
    standin.mkdir(parents=True)
    (standin / "__init__.py").write_text(
        "from portatrain.accelerators.sim import runtime\n"
        'runtime.install("tpu", dist_backend="tpu_dist", compile_backend="tpu", hardware_name="TPU v6e")\n'
    )
    pythonpath = f"{standin.parent}{os.pathsep}{ROOT / 'src'}"
    _assert_matches(_train("tpu", tmp_path / "tpu", env={"PYTHONPATH": pythonpath}), cpu_losses)


@pytest.mark.slow
def test_inductor_on_sim_matches_cpu(tmp_path: Path, cpu_losses: list) -> None:
    """``compile.backend=sim_inductor``: inductor's C++ kernels run on device memory (generating and
    compiling the kernels dominates the run)."""
    sim = _train("sim", tmp_path / "sim", "compile.enabled=true", "compile.backend=sim_inductor")
    _assert_matches(sim, cpu_losses)


def test_trainer_step_on_sim_makes_no_host_sync_or_fallback(tmp_path: Path) -> None:
    """No host sync in a training step, on the device that counts: three ``train_step`` calls, zero offences."""
    out = run_python(
        f"""
        from pathlib import Path
        from tests.helpers import TINY, compose_config
        from portatrain.accelerators.sim import counters
        from portatrain.trainer import Trainer

        overrides = [o for o in TINY if not o.startswith("device=")] + ["device=sim", "checkpoint.enabled=false"]
        trainer = Trainer(compose_config(overrides, Path({str(tmp_path / "run")!r})))
        batches = iter(trainer.train_loader)
        first = next(batches)
        trainer.train_step([first])                     # first step: lazy optimizer state
        counters.reset()
        with counters.expect_no_sync_or_fallback() as seen:
            for _ in range(3):
                trainer.train_step([next(batches)])
        print("transfers", seen.transfers)
        trainer.close()
        """,
        env={"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )
    assert out.strip().splitlines()[-1].startswith("transfers {'h2d':")
