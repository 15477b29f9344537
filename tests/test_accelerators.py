"""Accelerator discovery and adapters, with fake vendor packages standing in for absent hardware."""

from __future__ import annotations

import os
import subprocess
import types
from pathlib import Path

import pytest
import torch

from portatrain.accelerators import ACCELERATORS, AUTO_ORDER, DeviceUnavailableError, resolve_accelerator
from portatrain.accelerators.cpu import default_threads
from portatrain.accelerators.neuron import NeuronAccelerator
from portatrain.accelerators.tpu import TPUAccelerator
from tests.fork_server import IMPORT_TIME_ENV
from tests.helpers import python

ROOT = Path(__file__).resolve().parents[1]


def bare_env(**env: str) -> dict[str, str]:
    """``ENV`` and none of this process's variables (an adapter reads the environment), but for those
    that keep the process a fork of the fork server: its socket, and the variables read while a
    library loads, in which a fork must agree with the server (``tests/fork_server.py``)."""
    keep = ("PORTATRAIN_FORK_SERVER", "PORTATRAIN_TEST_NO_FORK", *IMPORT_TIME_ENV)
    return {**{k: v for k, v in os.environ.items() if k.startswith(keep)}, "OMP_NUM_THREADS": "1", **env}


def _run_with_fake_vendor(tmp_path: Path, module: str, body: str, code: str) -> subprocess.CompletedProcess:
    pkg = tmp_path / module
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    env = bare_env(PYTHONPATH=f"{tmp_path}:{ROOT / 'src'}", PATH="/usr/bin:/bin")
    return subprocess.run(python("-c", code), capture_output=True, text=True, env=env, timeout=120)


def test_auto_order_and_registry() -> None:
    assert AUTO_ORDER == ("tpu", "neuron", "cuda", "cpu")
    assert {"cpu", "cuda", "tpu", "neuron", "mps"} <= set(ACCELERATORS)  # plus sim (simulated device)


def test_auto_picks_cpu_here_and_probes_it() -> None:
    acc = resolve_accelerator("auto")
    assert acc.name == "cpu" and acc.device == torch.device("cpu")
    assert acc.dist_backend == "gloo" and acc.compile_backend == "inductor"
    assert acc.default_dtype == torch.float32


def test_cpu_threads_leave_a_core_to_the_host_and_share_the_rest() -> None:
    assert default_threads(cores=2, local_processes=1) == 1
    assert default_threads(cores=16, local_processes=1) == 15
    assert default_threads(cores=16, local_processes=4) == 3
    assert default_threads(cores=1, local_processes=1) == 1
    assert default_threads(cores=2, local_processes=8) == 1


def test_auto_announces_its_choice_once_and_the_skipped_devices_at_debug(caplog) -> None:
    caplog.set_level("DEBUG", logger="portatrain.accelerators")
    resolve_accelerator("auto")
    resolve_accelerator("auto")  # a dry run asks twice (dtype, static shapes)
    info = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len([m for m in info if m.startswith("device=auto selected")]) <= 1
    assert not [m for m in info if "skipped" in m]


def test_cpu_memory_stats_report_rss() -> None:
    stats = resolve_accelerator("cpu").memory_stats()
    assert stats["peak_rss"] >= stats["rss"] > 10 * 2**20


def test_unknown_device_names_the_choices() -> None:
    with pytest.raises(
        DeviceUnavailableError, match=r"device='gpu' is not a known device; choose one of auto, cpu"
    ):
        resolve_accelerator("gpu")


@pytest.mark.parametrize(("name", "module"), [("tpu", "torch_tpu"), ("neuron", "torch_neuronx")])
def test_explicit_vendor_device_missing(name: str, module: str) -> None:
    with pytest.raises(DeviceUnavailableError) as err:
        resolve_accelerator(name)
    message = str(err.value)
    assert f"device={name} was requested" in message and module in message and "Fix:" in message


def test_broken_vendor_package_is_reported_and_skipped_by_auto(tmp_path: Path) -> None:
    """A vendor stack that is installed but fails to import: explicit request explains, auto moves on."""
    code = """
from portatrain.accelerators import resolve_accelerator, DeviceUnavailableError
print("AUTO", resolve_accelerator("auto").name)
try:
    resolve_accelerator("neuron")
except DeviceUnavailableError as e:
    print("ERR", e)
"""
    out = _run_with_fake_vendor(
        tmp_path, "torch_neuronx", "raise RuntimeError('libnrt.so not found')\n", code
    )
    assert out.returncode == 0, out.stderr
    assert "AUTO cpu" in out.stdout
    assert "importing torch_neuronx failed: RuntimeError: libnrt.so not found" in out.stdout


def test_vendor_that_imports_but_has_no_device_fails_the_probe(tmp_path: Path) -> None:
    """torch_tpu imports fine but no `tpu` device is registered with torch: no silent CPU fallback."""
    code = """
from portatrain.accelerators import resolve_accelerator, DeviceUnavailableError
import sys
try:
    resolve_accelerator("tpu")
except DeviceUnavailableError as e:
    print("ERR", e)
print("IMPORTED", "torch_tpu" in sys.modules)
"""
    out = _run_with_fake_vendor(tmp_path, "torch_tpu", "", code)
    assert out.returncode == 0, out.stderr
    assert "ERR device=tpu was requested but cannot be used" in out.stdout
    assert "IMPORTED True" in out.stdout


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("TPU v4", torch.bfloat16, 275.0),
        ("TPU v5e", torch.bfloat16, 197.0),
        ("TPU v5p", torch.bfloat16, 459.0),
        ("TPU v6e", torch.bfloat16, 918.0),
        ("TPU v7", torch.bfloat16, 2307.0 / 2),  # two devices per chip
        ("TPU v6e", torch.float32, None),  # no published fp32 matmul rate
        ("TPU", torch.bfloat16, None),  # what get_device_name returns for an unknown generation
    ],
)
def test_tpu_peak_per_device_from_get_device_name(monkeypatch, name, dtype, tflops) -> None:
    monkeypatch.setattr(torch, "tpu", types.SimpleNamespace(get_device_name=lambda: name), raising=False)
    acc = TPUAccelerator(0)
    assert acc.device_name() == name
    peak = acc.peak_flops(dtype)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


@pytest.mark.parametrize(
    ("chip", "lnc", "dtype", "tflops"),
    [
        ("trn2", None, torch.bfloat16, 667.0 / 4),  # default LNC=2: 4 logical cores per chip
        ("trn2", "2", torch.float32, 181.0 / 4),
        ("trn2", "1", torch.bfloat16, 667.0 / 8),
        ("trn3", None, torch.bfloat16, 671.0 / 4),
        ("TRN3", None, torch.float32, 183.0 / 4),
        (None, None, torch.bfloat16, None),
    ],
)
def test_neuron_peak_per_logical_core(monkeypatch, chip, lnc, dtype, tflops) -> None:
    for var, value in (("PORTATRAIN_NEURON_CHIP", chip), ("NEURON_LOGICAL_NC_CONFIG", lnc)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    peak = NeuronAccelerator(0).peak_flops(dtype)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


class _FakeDevice(NeuronAccelerator):
    """The neuron adapter driving a device torch knows under ``fakedev`` (no vendor stack needed)."""

    device_type = "fakedev"

    def _is_current_accelerator(self) -> bool:
        return True


def test_device_rng_without_default_generators_is_saved_through_the_device_module(monkeypatch) -> None:
    generator = torch.Generator().manual_seed(5)
    module = types.SimpleNamespace(
        get_rng_state=lambda index: generator.get_state(),
        set_rng_state=lambda state, index: generator.set_state(state),
    )
    monkeypatch.setattr(torch, "fakedev", module, raising=False)
    acc = _FakeDevice(0)
    state = acc.get_rng_state()
    first = torch.rand(3, generator=generator)
    acc.set_rng_state(state)
    assert sorted(state) == ["cpu", "fakedev"] and torch.equal(torch.rand(3, generator=generator), first)


def test_device_rng_that_cannot_be_saved_is_warned_about_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch, "fakedev", types.SimpleNamespace(), raising=False)
    acc = _FakeDevice(0)
    with caplog.at_level("WARNING", logger="portatrain.accelerators.base"):
        assert sorted(acc.get_rng_state()) == ["cpu"]
        acc.get_rng_state()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "fakedev exposes no device RNG state" in warnings[0]
