"""Kubernetes: a JobSet for a TPU slice (GKE) and a Kubeflow PyTorchJob for GPU or Trainium nodes.

Both run one pod per host, each pod one ``torchrun`` agent with ``procs_per_node`` workers, meeting in
a c10d rendezvous keyed by the job name (also the run directory's name, ``runs/<recipe>/<job name>``;
mount shared storage at the container's working directory to keep runs and checkpoints).

* **JobSet** (``jobset.x-k8s.io/v1alpha2``): one replicated Job of ``nodes`` indexed pods on nodes
  selected by ``cloud.google.com/gke-tpu-accelerator`` / ``gke-tpu-topology``, each requesting
  ``procs_per_node`` ``google.com/tpu`` chips. JobSet gives every pod a stable DNS name
  ``<jobset>-<job>-<job index>-<pod index>.<jobset>``; the first pod hosts the rendezvous.
* **PyTorchJob** (``kubeflow.org/v1``): one ``Master`` and ``nodes - 1`` ``Worker`` replicas. The
  training operator injects ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` (the master's service), which the
  command references as ``$(PET_MASTER_ADDR)`` -- Kubernetes expands it from the container's
  environment. Resources: ``nvidia.com/gpu`` for ``device=cuda``, ``aws.amazon.com/neuroncore`` for
  ``device=neuron`` (one process per NeuronCore).

The TPU names follow GKE's documentation; that ``torch_tpu`` is launched one process per chip with
torchrun is an assumption we could not verify without the hardware (see README).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import yaml

from portatrain.launch import describe_job, job_name, torchrun_args

PYTORCHJOB_RESOURCES = {"cuda": "nvidia.com/gpu", "neuron": "aws.amazon.com/neuroncore"}
"""Device type -> the extended resource a PyTorchJob pod requests, one per process."""
TPU_RESOURCE = "google.com/tpu"
_CONTAINER_PORT = 29500


def problems(cfg: Any) -> list[str]:
    """Everything that keeps ``cfg`` from rendering as a Kubernetes job, each with its fix."""
    launch = cfg.parallel.launch
    found = []
    if not launch.image:
        found.append(
            f"parallel.launch.scheduler={launch.scheduler} needs a container image: set "
            "parallel.launch.image=REGISTRY/IMAGE:TAG (an image with portatrain installed)"
        )
    if launch.scheduler == "pytorchjob" and cfg.device.type not in PYTORCHJOB_RESOURCES:
        found.append(
            f"parallel.launch.scheduler=pytorchjob requests one accelerator per process, but device="
            f"{cfg.device.type} names none; set device=cuda (GPU nodes) or device=neuron (Trainium nodes)"
        )
    if launch.scheduler == "jobset":
        if cfg.device.type not in ("tpu", "auto"):
            found.append(
                f"parallel.launch.scheduler=jobset renders a TPU slice, but device={cfg.device.type}; "
                "set device=tpu, or use parallel.launch.scheduler=pytorchjob for GPU/Trainium nodes"
            )
        try:
            chips = math.prod(int(d) for d in str(launch.tpu_topology).split("x"))
        except ValueError:
            found.append(f"parallel.launch.tpu_topology={launch.tpu_topology!r} must look like 2x2x2")
        else:
            if chips != launch.nodes * launch.procs_per_node:
                found.append(
                    f"parallel.launch.tpu_topology={launch.tpu_topology} has {chips} chips but "
                    f"nodes({launch.nodes}) * procs_per_node({launch.procs_per_node}) = "
                    f"{launch.nodes * launch.procs_per_node}; set nodes to {chips} / chips per host"
                )
    return found


def _container(cfg: Any, name: str, command: list[str], resource: str) -> dict[str, Any]:
    launch = cfg.parallel.launch
    count = launch.procs_per_node
    container: dict[str, Any] = {
        "name": name,
        "image": launch.image,
        "command": command,
        "resources": {"limits": {resource: count}, "requests": {resource: count}},
        "ports": [{"containerPort": launch.rdzv_port, "name": "rendezvous"}],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],  # data-loader workers share memory
    }
    env = [{"name": k, "value": str(v)} for k, v in launch.env.items()]
    if env:
        container["env"] = env
    if launch.setup:  # shell set-up lines: run the command through bash after them
        script = " && ".join([*launch.setup, 'exec "$@"'])
        container["command"] = ["bash", "-c", script, "--", *command]
    return container


_SHM_VOLUME = {"name": "dshm", "emptyDir": {"medium": "Memory"}}


def render_jobset(cfg: Any, overrides: Sequence[str]) -> str:
    """A JobSet running ``portatrain <overrides>`` on a TPU slice of ``nodes`` hosts."""
    launch = cfg.parallel.launch
    name = job_name(cfg)
    head = f"{name}-workers-0-0.{name}"  # JobSet's DNS name of the first pod
    command = [
        "torchrun",
        *torchrun_args(
            nnodes=launch.nodes,
            nproc_per_node=launch.procs_per_node,
            rdzv_endpoint=f"{head}:{launch.rdzv_port}",
            rdzv_id=name,
        ),
        "-m",
        "portatrain",
        *overrides,
    ]
    pod_spec = {
        "restartPolicy": "Never",
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": launch.tpu_accelerator,
            "cloud.google.com/gke-tpu-topology": launch.tpu_topology,
        },
        "containers": [_container(cfg, "portatrain", command, TPU_RESOURCE)],
        "volumes": [_SHM_VOLUME],
    }
    manifest = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": launch.namespace,
            # One slice per node pool: no two jobs share the slice's hosts.
            "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
        },
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": launch.nodes,
                            "completions": launch.nodes,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "template": {"spec": pod_spec},
                        }
                    },
                }
            ],
        },
    }
    return _dump(manifest, cfg, "JobSet")


def render_pytorchjob(cfg: Any, overrides: Sequence[str]) -> str:
    """A Kubeflow PyTorchJob running ``portatrain <overrides>`` on ``nodes`` GPU or Trainium hosts."""
    launch = cfg.parallel.launch
    name = job_name(cfg)
    command = [
        "torchrun",
        *torchrun_args(
            nnodes=launch.nodes,
            nproc_per_node=launch.procs_per_node,
            rdzv_endpoint="$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
            rdzv_id=name,
        ),
        "-m",
        "portatrain",
        *overrides,
    ]
    resource = PYTORCHJOB_RESOURCES[cfg.device.type]

    def replica(count: int) -> dict[str, Any]:
        return {
            "replicas": count,
            "restartPolicy": "Never",
            "template": {
                "spec": {
                    # The training operator finds the container by this name.
                    "containers": [_container(cfg, "pytorch", command, resource)],
                    "volumes": [_SHM_VOLUME],
                }
            },
        }

    specs = {"Master": replica(1)}
    if launch.nodes > 1:
        specs["Worker"] = replica(launch.nodes - 1)
    manifest = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": launch.namespace},
        "spec": {
            "nprocPerNode": str(launch.procs_per_node),
            "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }
    return _dump(manifest, cfg, "PyTorchJob")


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # repeated blocks written out, no &id001 anchors
        return True


def _dump(manifest: dict[str, Any], cfg: Any, kind: str) -> str:
    header = (
        f"# portatrain {kind}: {describe_job(cfg)}.\n"
        "# Rendered by `portatrain render`; submit with `kubectl apply -f FILE`.\n"
    )
    return header + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def render(cfg: Any, overrides: Sequence[str]) -> Any:
    """The JobSet or PyTorchJob for ``cfg`` (``parallel.launch.scheduler``)."""
    from portatrain.launch import RenderedJob, job_overrides

    args = job_overrides(overrides)
    if cfg.parallel.launch.scheduler == "jobset":
        text = render_jobset(cfg, args)
    else:
        text = render_pytorchjob(cfg, args)
    return RenderedJob(text, "job.yaml", ("kubectl", "apply", "-f"), name=job_name(cfg))
