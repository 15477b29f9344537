"""Contract tests of the TPU and Neuron adapters against stand-ins for the real vendor stacks.

The stand-ins (``tests/vendor_standins``) reproduce, each citing its source, what the adapters
depend on: TorchTPU's closed legacy ``torch.tpu.*`` API, one device bound per worker, the
backend names each stack registers, Neuron's asynchronous allocator. Each scenario runs in a
process of its own (a stand-in renames torch's PrivateUse1 backend, which cannot be undone; a fork
of the fork server, which imported torch and never touched PrivateUse1, starts as clean) and
prints one JSON record that the tests below check. The adapters' device work on real tensors
is covered on the simulated device (``device=sim`` impersonating ``tpu``/``neuron``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
from pathlib import Path

import pytest

from portatrain.accelerators import DeviceUnavailableError, resolve_accelerator
from portatrain.accelerators.neuron import NEURON_PIP_INDEX
from tests.helpers import python
from tests.test_accelerators import bare_env

ROOT = Path(__file__).resolve().parents[1]
STANDINS = ROOT / "tests" / "vendor_standins"
VENDOR_STACKS = ("torch_tpu", "torch_neuronx", "torch_xla")

_PRELUDE = """
import json, logging, warnings
import torch, torch.distributed as dist
from portatrain.accelerators import ACCELERATORS, resolve_accelerator
out = {}

def init_world_of_one(backend):
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    groups = [dist.get_backend(), dist.get_world_size()]
    dist.destroy_process_group()
    return groups
"""


def _scenario(code: str, **env: str) -> dict:
    full_env = bare_env(
        PYTHONPATH=f"{STANDINS}{os.pathsep}{ROOT / 'src'}",
        PATH=os.environ.get("PATH", "/usr/bin:/bin"),
        **env,
    )
    proc = subprocess.run(
        python("-c", _PRELUDE + code + "\nprint('RESULT', json.dumps(out))"),
        capture_output=True,
        text=True,
        env=full_env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


# -- TPU ---------------------------------------------------------------------------------------
TPU_CODE = """
import torch_tpu
try:
    torch.tpu.device_count()
except RuntimeError as exc:
    out["legacy_error"] = str(exc)

class LegacyTPU(type(ACCELERATORS["tpu"](0))):
    def device_count(self):  # what the adapter did before: the closed per-device module
        return torch.tpu.device_count()
out["legacy_adapter_reason"] = LegacyTPU(0).unavailable_reason()

acc = ACCELERATORS["tpu"](3)  # torchrun's LOCAL_RANK=3 on a 4-chip host
out["reason"] = acc.unavailable_reason()
out["index"], out["device"] = acc.index, str(acc.device)
acc.set_device()
torch_tpu.STATE.pending_bytes = 3000
before = torch_tpu.STATE.synchronize_calls
acc.synchronize()
out["synchronized"] = torch_tpu.STATE.synchronize_calls - before
out["memory"] = acc.memory_stats()
acc.manual_seed(1234)
out["seeded"] = torch.tpu.default_generators[0].initial_seed()
state = acc.get_rng_state()
out["rng_keys"] = sorted(state)
first = torch.randint(0, 2**30, (4,), generator=torch.tpu.default_generators[0]).tolist()
acc.set_rng_state(state)
again = torch.randint(0, 2**30, (4,), generator=torch.tpu.default_generators[0]).tolist()
out["rng_restored"] = first == again
out["device_name"] = acc.device_name()
out["peak_bf16"] = acc.peak_flops(torch.bfloat16)
out["peak_fp32"] = acc.peak_flops(torch.float32)
out["dist_backend"] = acc.dist_backend
out["world"] = init_world_of_one(acc.dist_backend)
out["tpu_groups"] = torch_tpu.created_process_groups
out["compile_backend"], out["static_shapes"] = acc.compile_backend, acc.static_shapes
"""


@pytest.fixture(scope="module")
def tpu() -> dict:
    return _scenario(TPU_CODE, LOCAL_RANK="3", STANDIN_TPU_DEVICES="4", STANDIN_TPU_NAME="TPU v7")


def test_tpu_legacy_device_api_is_closed_and_discovery_survives_it(tpu: dict) -> None:
    assert "internal to TorchTPU" in tpu["legacy_error"]
    assert "torch.accelerator.device_count" in tpu["legacy_error"]
    # An adapter on the legacy API gets a reason, not a crash; ours needs none of it.
    assert "internal to TorchTPU" in tpu["legacy_adapter_reason"]
    assert tpu["reason"] is None


def test_tpu_worker_drives_the_device_it_is_bound_to_not_local_rank(tpu: dict) -> None:
    assert (tpu["index"], tpu["device"]) == (0, "tpu:0")


def test_tpu_synchronize_memory_and_rng_go_through_torch_accelerator(tpu: dict) -> None:
    assert tpu["synchronized"] == 1
    assert tpu["memory"] == {"allocated": 3000, "reserved": 3000, "peak_allocated": 3000}
    assert tpu["seeded"] == 1234
    assert tpu["rng_keys"] == ["cpu", "tpu"] and tpu["rng_restored"]


def test_tpu_chip_identity_from_get_device_name_with_v7_two_devices_per_chip(tpu: dict) -> None:
    assert tpu["device_name"] == "TPU v7"
    assert tpu["peak_bf16"] == pytest.approx(2307e12 / 2)
    assert tpu["peak_fp32"] is None


def test_tpu_names_its_distributed_and_compile_backends(tpu: dict) -> None:
    assert tpu["dist_backend"] == "cpu:gloo,tpu:tpu_dist"
    assert tpu["world"][1] == 1 and tpu["tpu_groups"] == [[0, 1]]
    assert (tpu["compile_backend"], tpu["static_shapes"]) == ("tpu", True)


def test_tpu_stack_without_a_tpu_is_skipped_by_auto() -> None:
    """torch_tpu installed on a host with no TPU registers no device: auto must move on."""
    out = _scenario(
        """
out["reason"] = ACCELERATORS["tpu"](0).unavailable_reason()
out["auto"] = resolve_accelerator("auto").name
""",
        STANDIN_TPU_DEVICES="0",
    )
    assert out["reason"] == "0 tpu devices visible (torch.accelerator.current_accelerator() is None)"
    assert out["auto"] == "cpu"


# -- Neuron ------------------------------------------------------------------------------------
NEURON_CODE = """
import os, torch_neuronx
acc = ACCELERATORS["neuron"](int(os.environ["LOCAL_RANK"]))
out["reason"] = acc.unavailable_reason()
out["index"], out["device"] = acc.index, str(acc.device)
acc.set_device()
out["current"] = torch.accelerator.current_device_index()
torch_neuronx._queue_allocation(4096)
out["unsynchronized_read"] = torch_neuronx.memory_allocated()
out["memory"] = acc.memory_stats()
acc.manual_seed(7)
out["seeds"] = torch.neuron.seeds
out["rng_keys"] = sorted(acc.get_rng_state())
out["device_name"] = acc.device_name()
out["peak_bf16"] = acc.peak_flops(torch.bfloat16)
out["dist_backend"] = acc.dist_backend
out["world"] = init_world_of_one(acc.dist_backend)
out["neuron_groups"] = torch_neuronx.created_process_groups
out["compile_backend"] = acc.compile_backend
"""


def test_neuron_one_visible_core_per_process_is_index_0() -> None:
    out = _scenario(NEURON_CODE, LOCAL_RANK="5", NEURON_RT_VISIBLE_CORES="5", PORTATRAIN_NEURON_CHIP="trn2")
    assert out["reason"] is None
    assert (out["index"], out["device"], out["current"]) == (0, "neuron:0", 0)
    # The allocator is asynchronous: a plain read misses queued work, the adapter synchronizes first.
    assert out["unsynchronized_read"] == 0
    assert out["memory"]["allocated"] == 4096 and out["memory"]["peak_allocated"] == 4096
    assert out["seeds"] == [7] and out["rng_keys"] == ["cpu"]
    assert out["device_name"] == "Trainium trn2, logical NeuronCore (1/4 chip)"
    assert out["peak_bf16"] == pytest.approx(667e12 / 4)
    assert out["dist_backend"] == "cpu:gloo,neuron:neuron" and out["neuron_groups"] == [[0, 1]]
    assert out["compile_backend"] == "neuron"


def test_neuron_process_seeing_every_core_drives_its_local_rank() -> None:
    out = _scenario(NEURON_CODE, LOCAL_RANK="5", NEURON_LOGICAL_NC_CONFIG="1", PORTATRAIN_NEURON_CHIP="trn3")
    assert out["reason"] is None
    assert (out["index"], out["device"], out["current"]) == (5, "neuron:5", 5)
    assert out["device_name"] == "Trainium trn3, logical NeuronCore (1/8 chip)"
    assert out["peak_bf16"] == pytest.approx(671e12 / 8)


def test_neuron_local_rank_beyond_the_visible_cores_is_a_reason_not_a_crash() -> None:
    out = _scenario(
        'out["reason"] = ACCELERATORS["neuron"](9).unavailable_reason()',
        NEURON_RT_VISIBLE_CORES="0-3",
    )
    assert out["reason"].startswith("4 neuron device(s) visible to this process, need index 9")


def test_neuron_trn1_is_refused_with_the_supported_generations() -> None:
    out = _scenario(
        'out["reason"] = ACCELERATORS["neuron"](0).unavailable_reason()', PORTATRAIN_NEURON_CHIP="trn1"
    )
    assert "TorchNeuron supports trn2 and trn3 only" in out["reason"]


# -- install hints and import hygiene (this process, no stand-in) ------------------------------
def test_missing_neuron_stack_names_the_neuron_pip_repository() -> None:
    with pytest.raises(DeviceUnavailableError) as err:
        resolve_accelerator("neuron")
    message = str(err.value)
    assert f"--extra-index-url {NEURON_PIP_INDEX}" in message
    assert NEURON_PIP_INDEX == "https://pip.repos.neuron.amazonaws.com"
    assert "Trn2 or Trn3" in message and "Trn1" in message


# Function-scope imports of a vendor stack allowed outside the adapters, each run only when its
# feature is asked for on that vendor's device (the NKI kernel bridge needs TorchNeuron's nki_op).
LAZY_VENDOR_IMPORTS = {"src/portatrain/kernels/nki/bridge.py": {"torch_neuronx"}}


def _vendor_imports(path: Path) -> list[tuple[str, bool]]:
    """(vendor module, inside a function) for each import statement and each
    ``import_module``/``__import__`` of a literal name in ``path``."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found.extend((name, in_function) for name in names if name.split(".")[0] in VENDOR_STACKS)
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def test_only_the_adapters_name_a_vendor_stack_for_import() -> None:
    """portatrain never imports torch_tpu/torch_neuronx/torch_xla at module level anywhere, and in
    functions only where listed; the adapters import theirs through ``vendor_module`` in ``load()``."""
    offenders = {}
    for path in sorted((ROOT / "src" / "portatrain").rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        allowed = LAZY_VENDOR_IMPORTS.get(relative, set())
        bad = [name for name, lazy in _vendor_imports(path) if not (lazy and name.split(".")[0] in allowed)]
        if bad:
            offenders[relative] = bad
    assert offenders == {}
    vendor_modules = {
        cls.vendor_module for cls in __import__("portatrain.accelerators").accelerators.ACCELERATORS.values()
    }
    assert {"torch_tpu", "torch_neuronx"} <= vendor_modules
