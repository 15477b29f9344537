"""The TPU and Neuron adapters end to end on real tensors: the simulated device impersonating
``tpu``/``neuron`` under the vendor stand-ins (``tests/vendor_standins``, ``STANDIN_ON_SIM=1``).

The stand-in ``torch_tpu``/``torch_neuronx`` installs portatrain's sim device under the vendor's
device name and layers the vendor's Python surface on it (TorchTPU's closed legacy ``torch.tpu``
functions, its ``tpu_dist`` backend name, one device per TPU worker; TorchNeuron's ``neuron``
backend name and visible cores). The adapters then run unchanged: discovery with a probe
allocation, device index, seeding, RNG state, memory statistics, synchronize, process groups and
a few training steps under a real ``torchrun``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from portatrain.accelerators.sim._build import compiler_missing_reason
from tests.helpers import python, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
STANDINS = ROOT / "tests" / "vendor_standins"

pytestmark = pytest.mark.skipif(
    compiler_missing_reason() is not None,
    reason=f"the sim device cannot be built: {compiler_missing_reason()}",
)


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": f"{STANDINS}{os.pathsep}{ROOT / 'src'}{os.pathsep}{ROOT}",
        "STANDIN_ON_SIM": "1",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


_ADAPTER_RUN = """
import json, torch, torch.distributed as dist
from portatrain.accelerators import resolve_accelerator
from portatrain.accelerators.sim import counters
out = {}
kind, requested = "{kind}", {requested}
acc = resolve_accelerator(kind, requested)  # discovery, index choice, probe allocation + synchronize
out["index"], out["device"] = acc.index, str(acc.device)
try:
    getattr(torch, kind).device_count()
    out["legacy"] = "open"
except RuntimeError as exc:
    out["legacy"] = str(exc)
acc.set_device()
out["current"] = torch.accelerator.current_device_index()

acc.manual_seed(42)
a = torch.rand(8, device=acc.device)
acc.manual_seed(42)
b = torch.rand(8, device=acc.device)
out["seeded_equal"] = torch.equal(a.cpu(), b.cpu())
state = acc.get_rng_state()
out["rng_keys"] = sorted(state)
x = torch.rand(8, device=acc.device).cpu()
acc.set_rng_state(state)
y = torch.rand(8, device=acc.device).cpu()
out["rng_restored"] = torch.equal(x, y)

counters.take()
acc.synchronize()
out["synchronize_counted"] = counters.take().syncs.get("synchronize", 0)
before = acc.memory_stats()
block = torch.empty(1 << 20, dtype=torch.uint8, device=acc.device)
after = acc.memory_stats()
out["memory_keys"] = sorted(after)
out["memory_grew"] = after["allocated"] - before["allocated"]
out["peak_ge_allocated"] = after["peak_allocated"] >= after["allocated"]
del block

out["dist_backend"] = acc.dist_backend
dist.init_process_group(backend=acc.dist_backend, store=dist.HashStore(), rank=0, world_size=1)
t = torch.full((4,), 3.0, device=acc.device)
dist.all_reduce(t)
objects = [{"step": 1}]
dist.broadcast_object_list(objects, src=0)  # object collectives go through the cpu:gloo half
out["broadcast"] = objects[0]
out["all_reduce"] = t.cpu().tolist()
dist.destroy_process_group()
print("RESULT", json.dumps(out))
"""


def _adapter_run(kind: str, requested: int, **env: str) -> dict:
    code = _ADAPTER_RUN.replace("{kind}", kind).replace("{requested}", str(requested))
    proc = subprocess.run(python("-c", code), capture_output=True, text=True, env=_env(**env), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_tpu_adapter_on_the_sim_as_tpu() -> None:
    out = _adapter_run("tpu", 1, LOCAL_RANK="1")  # worker 1 of a torchrun job: bound to tpu:0
    assert (out["index"], out["device"], out["current"]) == (0, "tpu:0", 0)
    assert "internal to TorchTPU" in out["legacy"]
    assert out["seeded_equal"] and out["rng_restored"] and out["rng_keys"] == ["cpu", "tpu"]
    assert out["synchronize_counted"] == 1
    assert out["memory_keys"] == ["allocated", "peak_allocated", "reserved"]
    assert out["memory_grew"] >= 1 << 20 and out["peak_ge_allocated"]
    assert out["dist_backend"] == "cpu:gloo,tpu:tpu_dist" and out["all_reduce"] == [3.0] * 4
    assert out["broadcast"] == {"step": 1}


def test_neuron_adapter_on_the_sim_as_neuron() -> None:
    out = _adapter_run("neuron", 1, LOCAL_RANK="1", STANDIN_NEURON_CORES="2")  # process sees both cores
    assert (out["index"], out["device"], out["current"]) == (1, "neuron:1", 1)
    assert out["seeded_equal"] and out["rng_restored"]
    assert out["synchronize_counted"] >= 1  # memory_stats synchronizes too
    assert out["memory_keys"] == ["allocated", "peak_allocated", "reserved"]
    assert out["memory_grew"] >= 1 << 20 and out["peak_ge_allocated"]
    assert out["dist_backend"] == "cpu:gloo,neuron:neuron" and out["all_reduce"] == [3.0] * 4


TRAIN = [
    "data.num_documents=200",
    "data.seq_len=64",
    "data.batch_size=4",
    "trainer.steps=3",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "trainer.dtype=float32",  # the sim runs CPU kernels: bf16 matmuls are slow there
    "optim.warmup_steps=1",
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "env"), [("tpu", {}), ("neuron", {"STANDIN_NEURON_CORES": "2"})])
def test_two_workers_train_under_torchrun(tmp_path: Path, kind: str, env: dict[str, str]) -> None:
    """``torchrun --nproc_per_node 2 -m portatrain device=<kind>``: discovery, device index per
    worker, process groups on the vendor's backend name, FSDP2 and a few optimizer steps."""
    run_dir = tmp_path / "run"
    cmd = [*torchrun_command(2), "-m", "portatrain", f"device={kind}", f"run_dir={run_dir}", *TRAIN]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=_env(**env), timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = [
        json.loads(line) for path in run_dir.rglob("*.jsonl") for line in path.read_text().splitlines()
    ]
    steps = [r for r in records if "loss" in r and "step" in r]
    assert [r["step"] for r in steps][-1] == 3
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in steps)  # finite, positive
    assert all(r.get("memory_peak_bytes") for r in steps)  # device allocator statistics reached the log


_WORKER = """
import json, os, torch
from portatrain.accelerators import resolve_accelerator
from portatrain.distributed import dist_info_from_env, init_distributed, destroy_distributed
info = dist_info_from_env()
acc = resolve_accelerator("{kind}", info.local_rank)  # what the Trainer passes when device.index is unset
acc.set_device()
init_distributed(acc, info)
t = torch.full((2,), float(info.rank + 1), device=acc.device)
torch.distributed.all_reduce(t)
# One write per record (torchrun makes stdout unbuffered: print's pieces would interleave across ranks).
print("WORKER " + json.dumps({"rank": info.rank, "device": str(acc.device), "sum": t.cpu().tolist()}), flush=True)
destroy_distributed()
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "env", "devices"),
    [
        ("tpu", {}, ["tpu:0", "tpu:0"]),  # each TorchTPU worker is bound to one device
        ("neuron", {"STANDIN_NEURON_CORES": "2"}, ["neuron:0", "neuron:1"]),  # all cores visible
        ("neuron", {"NEURON_RT_VISIBLE_CORES": "3"}, ["neuron:0", "neuron:0"]),  # one core per process
    ],
)
def test_device_index_under_torchrun(
    tmp_path: Path, kind: str, env: dict[str, str], devices: list[str]
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.replace("{kind}", kind))
    cmd = [*torchrun_command(2), str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=_env(**env), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    # Both workers write to one pipe: their lines can interleave, so find every record, not every line.
    records = re.findall(r"WORKER (\{[^{}]*\})", proc.stdout)
    workers = sorted((json.loads(r) for r in records), key=lambda w: w["rank"])
    assert [w["device"] for w in workers] == devices
    assert all(w["sum"] == [3.0, 3.0] for w in workers)  # 1 + 2, reduced over the vendor's backend name
