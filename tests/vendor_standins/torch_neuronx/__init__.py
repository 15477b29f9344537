"""Stand-in for TorchNeuron (``torch_neuronx`` 2.13/2.14, the native backend), after AWS's Neuron docs.

Reproduces what portatrain's Neuron adapter depends on; each behaviour names the documentation
page it was taken from (awsdocs-neuron.readthedocs-hosted.com, source in aws-neuron/aws-neuron-sdk).
Test knobs: ``STANDIN_NEURON_CORES`` (logical NeuronCores on the "instance", default 64 as on a
trn2.48xlarge at LNC=2).

Two ways to stand in for the device itself: by default no tensors, ``torch.accelerator``
answered from :mod:`_privateuse1` state (with an asynchronous allocator); with ``STANDIN_ON_SIM=1``
portatrain's simulated device installed under the name ``neuron`` (real tensors and a process-group
backend; its allocator is synchronous), with the visible cores as its device count.

Not reproduced: the ``neuron`` compile backend, NKI, and autoload at ``import torch``.
"""

from __future__ import annotations

import os
import types

import _privateuse1
import torch
import torch.distributed as dist


def _visible_cores() -> int:
    """Neuron runtime configuration guide: NEURON_RT_VISIBLE_CORES gives each process "its own
    slice of cores" (a single index or a range like 2-3); unset, the process sees all of them."""
    total = int(os.environ.get("STANDIN_NEURON_CORES", "64"))
    spec = os.environ.get("NEURON_RT_VISIBLE_CORES")
    if not spec:
        return total
    first, _, last = spec.partition("-")
    return int(last or first) - int(first) + 1


# pytorch-native-overview.rst FAQ: TorchNeuron "integrates through PyTorch's standard PrivateUse1
# device backend mechanism"; the device is "neuron" (torch/guides/torch-distributed).
STATE = _privateuse1.DeviceState("neuron", count=_visible_cores())
created_process_groups: list[tuple[int, int]] = []


def _queue_allocation(nbytes: int) -> None:
    """Test hook: device work that allocates ``nbytes`` is queued, not yet done."""
    STATE.pending_bytes += nbytes


# torch/guides/memory-profiling-guide: "torch-neuronx provides the memory APIs" (torch_neuronx.memory_*),
# and "The Neuron allocator is asynchronous. Always call torch.neuron.synchronize() before you read
# any memory statistic. Without it, a read shows only the work that the device has completed so far".
def memory_allocated() -> int:
    return STATE.completed_bytes


def memory_stats() -> dict[str, int]:
    return {"allocated_bytes.all.current": STATE.completed_bytes}


def _make_device_module() -> types.ModuleType:
    neuron = types.ModuleType("torch.neuron")
    neuron.synchronize = lambda device=None: STATE.synchronize()  # memory-profiling-guide
    neuron.device_count = lambda: STATE.count
    neuron._is_in_bad_fork = lambda: False  # torch/random.py _seed_custom_device needs it
    neuron.seeds = []
    neuron.manual_seed_all = neuron.seeds.append
    return neuron


def _create_process_group(store, rank, size, timeout):  # noqa: ANN001
    """The "neuron" process-group stand-in: a gloo group (the stand-in has no device)."""
    created_process_groups.append((rank, size))
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _install_on_sim() -> None:
    os.environ.setdefault("SIM_DEVICE_COUNT", str(STATE.count))
    from portatrain.accelerators.sim import runtime

    # torch/guides/torch-distributed: backend "neuron"; pytorch-native-overview.rst: compile backend "neuron".
    neuron = runtime.install("neuron", dist_backend="neuron", compile_backend="neuron")
    # The documented torch_neuronx.memory_* read the allocator (memory-profiling-guide).
    globals()["memory_allocated"] = lambda: int(torch.accelerator.memory.memory_allocated())
    globals()["memory_stats"] = lambda: torch.accelerator.memory.memory_stats()
    del neuron.memory_allocated, neuron.memory_stats  # TorchNeuron documents them on torch_neuronx


if os.environ.get("STANDIN_ON_SIM") == "1":
    _install_on_sim()
else:
    _privateuse1.rename_privateuse1(STATE.device_type)
    _privateuse1.register_device_module("neuron", _make_device_module())
    _privateuse1.install(STATE)
    # torch/guides/torch-distributed: "import torch_neuronx  # Registers the Neuron device and
    # distributed backend", then dist.init_process_group(backend="neuron", ...).
    dist.Backend.register_backend("neuron", _create_process_group, devices=["neuron"])
