"""What a Kubernetes job may request, and everything that keeps a config from rendering as one.

- the accelerators' extended resources (``nvidia.com/gpu``, ``aws.amazon.com/neuron``,
  ``google.com/tpu``, EFA), Trainium's ranks per chip and instance, and GKE's TPU slice shapes
  (:data:`TPU_ACCELERATORS`, :func:`tpu_layout`: hosts x chips x devices of a topology);
- :func:`problems` -- every problem of ``launch`` for ``jobset`` and ``pytorchjob``, each
  with its fix, reported together.

``portatrain.launch.kubernetes``'s docstring says what the rendered jobs do with these.
"""

from __future__ import annotations

import math
from typing import Any

PYTORCHJOB_RESOURCES = {"cuda": "nvidia.com/gpu", "neuron": "aws.amazon.com/neuron"}
"""Device type -> the extended resource a PyTorchJob pod requests."""
TPU_RESOURCE = "google.com/tpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"

NEURON_CORES_PER_CHIP = 4
"""Logical NeuronCores (ranks) per Trainium2 chip at the default LNC=2 (AWS Neuron docs,
``logical-neuroncore-config``)."""
NEURON_RANKS_PER_INSTANCE = 64
"""Ranks on a trn2.48xlarge: 16 chips x 4 logical NeuronCores (AWS Neuron docs)."""
TRN2_EFA_INTERFACES = 16
"""EFA interfaces of a trn2.48xlarge (aws-neuron-eks-samples trn2 node-group template); all of them
go to the container (AWS Neuron docs, ``deploy/faq``)."""

# GKE's gke-tpu-accelerator label -> (topology dimensions, chips per host of a multi-host slice,
# chips of the largest single-host slice, devices per chip). Devices per chip: TPU7x splits each
# chip's two cores into two devices (torch_tpu 0.2.0, torch_tpu/_internal/utils/hardware.py).
TPU_ACCELERATORS: dict[str, tuple[int, int, int, int]] = {
    "tpu-v4-podslice": (3, 4, 4, 1),
    "tpu-v5-lite-podslice": (2, 4, 8, 1),  # v5e
    "tpu-v5p-slice": (3, 4, 4, 1),
    "tpu-v6e-slice": (2, 4, 8, 1),
    "tpu7x": (3, 4, 4, 2),
}


def tpu_layout(accelerator: str, topology: str) -> tuple[int, int, int] | str:
    """(hosts, chips per host, devices per chip) of a slice, or why the pair is inconsistent."""
    if accelerator not in TPU_ACCELERATORS:
        return (
            f"launch.tpu_accelerator={accelerator!r} is not a GKE TPU accelerator; "
            f"choose one of {', '.join(TPU_ACCELERATORS)}"
        )
    dims, per_host, single_host_max, devices_per_chip = TPU_ACCELERATORS[accelerator]
    parts = str(topology).split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        return f"launch.tpu_topology={topology!r} must look like 2x2x2 (3-D) or 2x4 (2-D)"
    if len(parts) != dims:
        fitting = [a for a, spec in TPU_ACCELERATORS.items() if spec[0] == len(parts)]
        return (
            f"launch.tpu_topology={topology} is {len(parts)}-D, but "
            f"tpu_accelerator={accelerator} slices are {dims}-D; set launch.tpu_accelerator to "
            f"one of {', '.join(fitting)}, or a {dims}-D topology"
        )
    chips = math.prod(int(p) for p in parts)
    if chips <= single_host_max:
        return 1, chips, devices_per_chip
    if chips % per_host:
        return f"launch.tpu_topology={topology} has {chips} chips, not a multiple of {per_host} per host"
    return chips // per_host, per_host, devices_per_chip


def problems(cfg: Any) -> list[str]:
    """Everything that keeps ``cfg`` from rendering as a Kubernetes job, each with its fix."""
    launch = cfg.launch
    found = []
    if not launch.image:
        found.append(
            f"launch.scheduler={launch.scheduler} needs a container image: set "
            "launch.image=REGISTRY/IMAGE:TAG (an image with portatrain installed)"
        )
    if not launch.volume_claim:
        found.append(
            "a Kubernetes job needs shared storage for its run directory (checkpoints must outlive a pod "
            "and be written by every pod): set launch.volume_claim=CLAIM, a ReadWriteMany "
            f"PersistentVolumeClaim in namespace {launch.namespace}"
        )
    restarts = launch.max_restarts
    if not isinstance(restarts, int) or restarts < 0:
        found.append(f"launch.max_restarts={restarts!r} must be a whole number >= 0")
    if launch.scheduler == "pytorchjob":
        found += _pytorchjob_problems(cfg)
    if cfg.fault_tolerance.enabled and launch.scheduler != "pytorchjob":
        found.append(
            f"fault_tolerance.enabled=true renders one PyTorchJob per replica group (GPU nodes), not a "
            f"{launch.scheduler}; set launch.scheduler=pytorchjob device=cuda"
        )
    if launch.scheduler == "jobset":
        if cfg.device.type not in ("tpu", "auto"):
            found.append(
                f"launch.scheduler=jobset renders a TPU slice, but device={cfg.device.type}; "
                "set device=tpu, or use launch.scheduler=pytorchjob for GPU/Trainium nodes"
            )
        layout = tpu_layout(launch.tpu_accelerator, launch.tpu_topology)
        if isinstance(layout, str):
            found.append(layout)
        else:
            hosts, chips_per_host, devices_per_chip = layout
            devices = chips_per_host * devices_per_chip
            if (launch.nodes, launch.procs_per_node) != (hosts, devices):
                found.append(
                    f"tpu_topology={launch.tpu_topology} on {launch.tpu_accelerator} is {hosts} host(s) x "
                    f"{chips_per_host} chip(s) x {devices_per_chip} device(s) per chip, but nodes="
                    f"{launch.nodes} and procs_per_node={launch.procs_per_node}; set "
                    f"launch.nodes={hosts} launch.procs_per_node={devices} "
                    "(one process per device)"
                )
    return found


def _pytorchjob_problems(cfg: Any) -> list[str]:
    launch = cfg.launch
    found = []
    if cfg.device.type not in PYTORCHJOB_RESOURCES:
        found.append(
            f"launch.scheduler=pytorchjob requests one accelerator per process, but device="
            f"{cfg.device.type} names none; set device=cuda (GPU nodes) or device=neuron (Trainium nodes)"
        )
    elif cfg.device.type == "neuron":
        ranks = launch.procs_per_node
        if ranks % NEURON_CORES_PER_CHIP or ranks > NEURON_RANKS_PER_INSTANCE:
            found.append(
                f"launch.procs_per_node={ranks}: Trainium runs one process per logical NeuronCore, "
                f"{NEURON_CORES_PER_CHIP} per Trainium2 chip (LNC=2), {NEURON_RANKS_PER_INSTANCE} on a "
                f"trn2.48xlarge; set procs_per_node={NEURON_RANKS_PER_INSTANCE} (a whole instance) or a "
                f"multiple of {NEURON_CORES_PER_CHIP}"
            )
    elif launch.nodes > 1 and launch.efa is None:
        found.append(
            f"a {launch.nodes}-node GPU job needs RDMA for its collectives, or NCCL falls back to TCP: set "
            f"launch.efa=N (the instance's EFA interfaces, {EFA_RESOURCE}, on EKS), or "
            "launch.efa=0 on a cluster without EFA"
        )
    efa = launch.efa
    if efa is not None and (not isinstance(efa, int) or efa < 0):
        found.append(f"launch.efa={efa!r} must be a whole number >= 0 (EFA interfaces per pod)")
    return found
