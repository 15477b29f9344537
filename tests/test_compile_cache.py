"""Compiled graphs survive a restart (``compile.cache``, ``portatrain.compile.CompileCache``).

The end-to-end test trains a tiny compiled model in two fresh processes that share one cache
directory: the first compiles (cache misses) and saves the portable artifacts, the second must find
every graph on disk -- inductor's FX graph cache and the AOTAutograd cache report hits and no misses.
Both are forks of the suite's fork server (``tests/fork_server.py``), which imported torch but never
compiled: each starts with empty in-memory caches, as a new interpreter would, without its imports.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from portatrain.accelerators.cpu import CPUAccelerator
from portatrain.accelerators.neuron import NeuronAccelerator
from portatrain.compile import CompileCache
from tests.helpers import ROOT, TINY, compose_config, python

# One process: train 2 compiled steps, print dynamo's cache counters as JSON on the last line.
SCRIPT = """
import json, sys
from torch._dynamo.utils import counters
from tests.helpers import fit
fit(sys.argv[2:], __import__("pathlib").Path(sys.argv[1]))
print(json.dumps({
    "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
    "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
    "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
    "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
}))
"""


def _train_in_fresh_process(run_dir: Path, overrides: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        python("-c", SCRIPT, str(run_dir), *overrides),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_restart_finds_every_compiled_graph_on_disk(tmp_path: Path) -> None:
    cache = tmp_path / "shared_cache"
    overrides = ["compile.enabled=true", "trainer.steps=2", f"compile.cache_dir={cache}"]
    first = _train_in_fresh_process(tmp_path / "first", overrides)
    assert first["fx_miss"] > 0 and first["fx_hit"] == 0, first
    assert (cache / CompileCache.ARTIFACTS).stat().st_size > 0
    assert any((cache / "inductor").iterdir())
    second = _train_in_fresh_process(tmp_path / "second", overrides)
    assert second["aot_miss"] == 0 and second["fx_miss"] == 0, second
    assert second["aot_hit"] + second["fx_hit"] >= first["fx_miss"] // 2, (first, second)


def test_cache_location_and_switches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PORTATRAIN_COMPILE_CACHE_DIR", raising=False)  # the suite sets a shared one
    cpu = CPUAccelerator()
    on = compose_config([*TINY, "compile.enabled=true"]).compile
    assert CompileCache.for_run(on, tmp_path, cpu, is_main=True).directory == tmp_path / "compile_cache"
    shared = compose_config([*TINY, "compile.enabled=true", f"compile.cache_dir={tmp_path / 's'}"]).compile
    assert CompileCache.for_run(shared, tmp_path, cpu, is_main=True).directory == tmp_path / "s"
    monkeypatch.setenv("PORTATRAIN_COMPILE_CACHE_DIR", str(tmp_path / "env"))
    assert CompileCache.for_run(on, tmp_path, cpu, is_main=True).directory == tmp_path / "env"
    assert CompileCache.for_run(shared, tmp_path, cpu, is_main=True).directory == tmp_path / "s"
    for off in (["compile.enabled=false"], ["compile.enabled=true", "compile.cache=false"]):
        assert (
            CompileCache.for_run(compose_config([*TINY, *off]).compile, tmp_path, cpu, is_main=True) is None
        )
    assert cpu.compile_cache_env(tmp_path) == {}


def test_neuron_cache_env_points_into_the_cache_unless_set(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TORCH_NEURONX_NEFF_CACHE_DIR", raising=False)
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", "s3://bucket/cache")
    env = NeuronAccelerator().compile_cache_env(tmp_path)
    assert env == {"TORCH_NEURONX_NEFF_CACHE_DIR": str((tmp_path / "neuron").resolve())}


def test_the_artifacts_file_is_checksummed_and_a_damaged_one_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What ``load_cache_artifacts`` is handed is exactly what ``save_cache_artifacts`` gave; a file
    whose bytes changed (or that carries no checksum) is named in one warning and not loaded."""
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    import portatrain.compile.cache as cache_module

    # activate() switches these on for the process, and sets the environment (deactivate() restores it).
    monkeypatch.setattr(inductor_config, "fx_graph_cache", inductor_config.fx_graph_cache)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", functorch_config.enable_autograd_cache)
    payload = b"\x80\x04compiled graphs" * 100
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (payload, None))
    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data))
    graphs = iter(range(10))
    monkeypatch.setattr(cache_module, "dynamo_graph_count", lambda: next(graphs))

    def start() -> CompileCache:
        cache = CompileCache(tmp_path)
        cache.activate()
        cache.deactivate()
        return cache

    writer = start()
    assert writer.save_if_compiled()  # a graph was compiled since activate()
    start()
    assert loaded == [payload]

    path = tmp_path / CompileCache.ARTIFACTS
    sealed = path.read_bytes()
    for damaged, why in (
        (sealed[:-1] + b"X", "its SHA-256 does not match"),
        (sealed[: len(sealed) // 2], "its SHA-256 does not match"),
        (payload, "it has no portatrain checksum header"),
    ):
        path.write_bytes(damaged)
        caplog.clear()
        with caplog.at_level("WARNING", logger="portatrain.compile.cache"):
            start()
        assert loaded == [payload], "a damaged artifacts file was handed to torch"
        (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
        assert str(path) in record.getMessage() and why in record.getMessage(), record.getMessage()
        assert "compiled again" in record.getMessage()
