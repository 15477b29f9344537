"""``device=sim``: a simulated accelerator that runs on the CPU and counts what real ones punish.

The sim device is a real out-of-tree PyTorch device (PrivateUse1, like TorchTPU and TorchNeuron):
its own allocator with statistics and an optional capacity, device guard, streams and events,
generators, process-group backend, and a C++ fallback that runs every op on its CPU kernel over the
same memory. Execution is synchronous, so it finds no stream races and measures no fallback cost;
what it does find is code that would stall or fall back on an accelerator: host syncs, data-
dependent shapes, mixed devices and ops marked unsupported (see :mod:`.counters`).

Modules (importing this package installs nothing; only :func:`runtime.install` changes global state):

* ``adapter``: :class:`SimAccelerator`, the ``device=sim`` adapter in the accelerator registry.
* ``runtime``: :func:`install` — build or load the extension, rename PrivateUse1, ``torch.sim``.
* ``counters``: host-sync/fallback counters, ``expect_no_sync_or_fallback()``, ``take()``.
* ``op_profiles``: op-coverage profiles (``profiles/*.json``): which aten ops TorchTPU / torch-xla
  run natively; the rest fall back to the CPU while one is in force.
* ``distributed``: the ``simccl`` process-group backend (gloo over CPU aliases of device memory).
* ``inductor``: the ``sim_inductor`` compile backend (inductor's CPU code generator on sim memory).
* ``settings``: the device's name and its environment settings, checked before anything is installed.
* ``errors``: its user errors (a bad setting, out of memory, an unsupported op hit under ``error``),
  which the CLI prints as one line.
* ``_build``: the cached JIT build of ``csrc/``.

Environment: ``SIM_DEVICE_COUNT`` (devices, 1 to 64, default 4), ``SIM_MEMORY_CAPACITY`` (per
device, e.g. ``512MiB``; unset = unlimited), ``SIM_COUNTERS_MODE`` (``count``/``warn``/``raise``),
``SIM_UNSUPPORTED_OPS`` and ``SIM_UNSUPPORTED_ACTION``, ``SIM_OP_PROFILE`` (the op-coverage profile of
the backend impersonated: operators outside it fall back to the CPU, :mod:`.op_profiles`),
``PORTATRAIN_SIM_BUILD_DIR`` (build cache).
A bad value is one error naming the variable and its fix (:mod:`.settings`).

Impersonation
-------------
One process can present the sim device under another name, so that code written for TorchTPU
or TorchNeuron runs with real tensors here: ``torch.device("tpu")`` allocates, ``torch.tpu`` exists
(``device_count``, ``synchronize``, ``manual_seed_all``, ``Stream``, ``Event``, memory functions),
and the generic ``torch.accelerator`` API (``current_accelerator()``, ``device_count()``,
``set_device_index()``, ``synchronize()``, ``memory_allocated()``/``memory_stats()``,
``get_memory_info()``) answers for it. Two equivalent ways:

* ``PORTATRAIN_SIM_AS=tpu`` (or ``neuron``) in the environment, then ``device=sim`` or
  ``runtime.install()``; ``SimAccelerator.device_type`` follows the variable.
* ``from portatrain.accelerators.sim import runtime; runtime.install("tpu")`` — e.g. in a stand-in
  ``torch_tpu/__init__.py`` put on ``PYTHONPATH`` in a subprocess, so that the TPU adapter's own
  ``load()`` (``import torch_tpu``) installs it and ``device=tpu`` runs end to end.

One name per process (torch renames PrivateUse1 once); the process-group backend is registered
for the chosen name, and the counters work the same under any name. The name also sets
``trainer.dtype=auto``'s precision (``SimAccelerator.default_dtype``): the impersonated device's, bf16
as ``tpu`` or ``neuron``, fp32 as plain ``sim``.
"""

from __future__ import annotations

from portatrain.accelerators.sim.adapter import SimAccelerator

__all__ = ["SimAccelerator"]
