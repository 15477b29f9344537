"""Kubernetes: a JobSet for a TPU slice (GKE) and a Kubeflow PyTorchJob for GPU or Trainium nodes.

Both run one pod per host, each pod one ``torchrun`` agent with ``procs_per_node`` workers, and
both are built to survive a real cluster:

* **Names.** Every rendering gets a fresh name, ``<job_name or portatrain-<recipe>>-<yymmdd-hhmmss>-<3
  random>``, at most 45 characters (JobSet's pod names ``<name>-workers-0-<i>-<5>`` stay within 63),
  DNS-1035 (a letter first). ``submit`` uses ``kubectl create``, so a name clash is an error, never an
  update of a running job.
* **Shared storage.** ``launch.volume_claim`` names a ReadWriteMany PersistentVolumeClaim,
  mounted on every pod at ``volume_mount``; the run directory is ``<volume_mount>/runs/<recipe>/<name>``
  on it (the job's command carries ``run_dir=``), so it follows the job. The trainer checks at
  start-up that every rank sees it (``portatrain.rundir``).
* **Restarts with resume.** The command carries ``checkpoint.resume=auto``. JobSet: a failed pod
  fails its Job (``backoffLimit: 0``) and the JobSet recreates all of them, up to ``max_restarts``
  times; a pod evicted by a disruption (preemption, maintenance) restarts the JobSet without counting
  (``podFailurePolicy`` on ``DisruptionTarget`` + ``RestartJobSetAndIgnoreMaxRestarts``). PyTorchJob:
  ``restartPolicy: OnFailure`` with ``runPolicy.backoffLimit: max_restarts``.
  ``terminationGracePeriodSeconds`` is ``save_grace`` + 30 s and torchrun's ``--shutdown-timeout`` is
  ``save_grace``: the SIGTERM before an eviction leaves the workers time to save.
* **Node rank from the pod index**, so rank 0 (metrics, the checkpoint index) has a fixed home:
  torchrun's static rendezvous with ``--node-rank`` = the Indexed Job's ``JOB_COMPLETION_INDEX``
  (JobSet, via TorchTPU's launch step) or the training operator's ``PET_NODE_RANK`` (master 0,
  worker i -> i + 1; kubeflow/training-operator v1.9.0 ``pkg/controller.v1/pytorch/envvar.go``).
* **Resources.** CPU and memory requests (``cpu``, ``memory``: the pod is not BestEffort, evicted
  first); the accelerators; EFA (``vpc.amazonaws.com/efa``) for multi-node jobs on AWS.

TPU (``jobset``): GKE's node selectors ``cloud.google.com/gke-tpu-accelerator`` and
``gke-tpu-topology``, checked against each other (generation, dimensions, chips per host); the pod
requests the host's chips (``google.com/tpu``); ``procs_per_node`` is devices per host (TPU7x has 2
devices per chip). TorchTPU needs its launch environment (slice-builder addresses, topology,
profiling session) decided before the workers spawn: the container runs
``python -m torch.tpu.distributed`` (torch_tpu 0.2.0 wheel,
``torch_tpu/_internal/distributed/distributed.py``), which prints it as shell assignments, with
``TPU_WORKER_HOSTNAMES`` (the pods' DNS names, which the step requires on multi-host),
``TORCH_TPU_DEVICES_PER_HOST`` and ``MASTER_PORT`` given; it derives ``NODE_RANK`` from
``JOB_COMPLETION_INDEX`` and ``MASTER_ADDR`` from the first host name.

Trainium (``pytorchjob``, ``device=neuron``): one rank per logical NeuronCore, 64 on a
trn2.48xlarge at the default LNC=2 (4 per Trainium2 chip); the pod requests chips
(``aws.amazon.com/neuron``) and, multi-node, the instance's 16 EFA interfaces (AWS Neuron docs:
``deploy/eks``, the trn2 node-group template of aws-neuron-eks-samples). GPU (``device=cuda``):
``nvidia.com/gpu`` per process; a multi-node GPU job must say whether it has EFA
(``launch.efa``).

Fault tolerance (``fault_tolerance.enabled=true``, ``portatrain.fault_tolerance``; GPU ``pytorchjob``
only, torchft's process groups being gloo and NCCL): one PyTorchJob per replica group
(``<name>-g<id>``, ``fault_tolerance.replica_id=<id>``), each restarted alone by the training operator
(``backoffLimit``) while the others train on, plus (unless ``fault_tolerance.lighthouse`` names one)
torchft's lighthouse as a one-pod Deployment behind a
Service (``<name>-lighthouse:29510``, ``portatrain lighthouse``) that every group's command names. All
groups share the run directory, each writing its ``replica_<id>`` inside.

Tested against the published CRD schemas (JobSet v0.12.0 and main, Kubeflow PyTorchJob v1.9.0) in
``tests/test_kubernetes.py``; not run on a real cluster here.
"""

from __future__ import annotations

import math
import random
import re
import shlex
import string
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from portatrain.launch.job import (
    RenderedJob,
    SubmittedJob,
    describe_job,
    job_overrides,
)
from portatrain.redact import is_secret

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

MAX_NAME = 45
"""JobSet pod names ``<jobset>-<replicated job>-<job index>-<pod index>-<5 random>`` must fit 63."""
# The training operator reads MASTER_PORT from the container port of this name (v1.9.0,
# pkg/apis/kubeflow.org/v1/pytorch_types.go PyTorchJobDefaultPortName).
_PORT_NAMES = {"pytorchjob": "pytorchjob-port", "jobset": "rendezvous"}
_RUN_VOLUME = "run-dir"


# -- names ------------------------------------------------------------------------------------------
def unique_job_name(base: str, *, now: float | None = None, rng: random.Random | None = None) -> str:
    """``<base>-<yymmdd-hhmmss>-<3 random>``: unique per submission, DNS-1035, <= 45 characters."""
    stamp = time.strftime("%y%m%d-%H%M%S", time.gmtime(now))
    tail = "".join(
        (rng or random.SystemRandom()).choice(string.ascii_lowercase + string.digits) for _ in range(3)
    )
    suffix = f"-{stamp}-{tail}"
    clean = re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-")
    if not clean or not clean[0].isalpha():
        clean = f"pt-{clean}".rstrip("-")
    clean = clean[: MAX_NAME - len(suffix)].rstrip("-")
    return clean + suffix


def is_dns1035(name: str, max_length: int = 63) -> bool:
    """A DNS-1035 label: lower-case letters, digits and ``-``, a letter first, no ``-`` last."""
    return len(name) <= max_length and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) is not None


def run_dir_for(cfg: Any, name: str) -> str:
    """The run directory of job ``name``: on the shared volume, named after the job."""
    mount = str(cfg.launch.volume_mount).rstrip("/")
    return f"{mount}/runs/{cfg.recipe}/{name}"


# -- validation ---------------------------------------------------------------------------------------
def _tpu_layout(accelerator: str, topology: str) -> tuple[int, int, int] | str:
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
        layout = _tpu_layout(launch.tpu_accelerator, launch.tpu_topology)
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


# -- manifests ----------------------------------------------------------------------------------------
def _efa(cfg: Any) -> int:
    launch = cfg.launch
    efa = launch.efa
    if efa is not None:
        return int(efa)
    return TRN2_EFA_INTERFACES if cfg.device.type == "neuron" and launch.nodes > 1 else 0


def _resources(cfg: Any, accelerator: str, count: int) -> dict[str, Any]:
    launch = cfg.launch
    extended = {accelerator: count}
    if cfg.launch.scheduler == "pytorchjob" and _efa(cfg):
        extended[EFA_RESOURCE] = _efa(cfg)
    requests = {
        "cpu": str(launch.cpu),
        "memory": str(launch.memory),
        **extended,
    }
    return {"requests": requests, "limits": dict(extended)}  # extended resources: limits == requests


def _container(cfg: Any, name: str, script: str, resources: dict[str, Any], env: dict[str, str]) -> dict:
    launch = cfg.launch
    all_env = {**env, **{k: str(v) for k, v in launch.env.items()}}
    container: dict[str, Any] = {
        "name": name,
        "image": launch.image,
        "command": ["bash", "-c", script],
        "resources": resources,
        "ports": [{"containerPort": launch.rdzv_port, "name": _PORT_NAMES[launch.scheduler]}],
        "volumeMounts": [
            {"name": _RUN_VOLUME, "mountPath": str(launch.volume_mount)},
            {"name": "dshm", "mountPath": "/dev/shm"},  # data-loader workers share memory
        ],
    }
    if all_env:
        container["env"] = [_env_var(k, v) for k, v in all_env.items()]
    return container


SECRET_NAME = "portatrain-secrets"
"""Kubernetes Secret the rendered jobs read secret environment variables from (``HF_TOKEN``...):
``kubectl create secret generic portatrain-secrets --from-literal=HF_TOKEN=...``."""


def _env_var(key: str, value: str) -> dict[str, Any]:
    """A container env entry; a secret's value (by its name or its shape: ``portatrain.redact.is_secret``)
    is never written into the manifest but read from
    :data:`SECRET_NAME` (``secretKeyRef``)."""
    if is_secret(key, value):
        return {"name": key, "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": key}}}
    return {"name": key, "value": value}


def _volumes(cfg: Any) -> list[dict[str, Any]]:
    claim = cfg.launch.volume_claim
    return [
        {"name": _RUN_VOLUME, "persistentVolumeClaim": {"claimName": str(claim)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]


def _script(cfg: Any, steps: list[str], torchrun: list[str], overrides: Sequence[str]) -> str:
    """``setup && launch steps && exec torchrun ... -m portatrain ...``; ``exec`` makes torchrun the
    container's main process, so the kubelet's SIGTERM reaches it (and through it the workers)."""
    command = " ".join([*torchrun, "-m", "portatrain", *(shlex.quote(o) for o in overrides)])
    return " && ".join([*cfg.launch.setup, *steps, f"exec {command}"])


def _grace(cfg: Any) -> int:
    return int(cfg.launch.save_grace)


def render_jobset(cfg: Any, overrides: Sequence[str], name: str) -> str:
    """A JobSet running ``portatrain <overrides>`` on a TPU slice of ``nodes`` hosts."""
    launch = cfg.launch
    _, chips_per_host, _ = _tpu_layout(launch.tpu_accelerator, launch.tpu_topology)  # type: ignore[misc]
    hosts = [f"{name}-workers-0-{i}.{name}" for i in range(launch.nodes)]  # JobSet's pod DNS names
    env = {
        "TPU_WORKER_HOSTNAMES": ",".join(hosts),
        "TORCH_TPU_DEVICES_PER_HOST": str(launch.procs_per_node),
        "MASTER_PORT": str(launch.rdzv_port),
    }
    launch_env = [
        # TorchTPU's launch step prints TORCH_TPU_* (exported to the workers), NNODES, NODE_RANK
        # (= JOB_COMPLETION_INDEX), MASTER_ADDR (the first host) and MASTER_PORT.
        "tpu_env=$(python -m torch.tpu.distributed)",
        'set -a && eval "$tpu_env" && set +a',
    ]
    torchrun = [
        "torchrun",
        '--nnodes="$NNODES"',
        '--node-rank="$NODE_RANK"',
        f"--nproc-per-node={launch.procs_per_node}",
        '--master-addr="$MASTER_ADDR"',
        '--master-port="$MASTER_PORT"',
        f"--rdzv-id={name}",
        f"--shutdown-timeout={_grace(cfg)}",
    ]
    pod_spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": _grace(cfg) + 30,
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": launch.tpu_accelerator,
            "cloud.google.com/gke-tpu-topology": launch.tpu_topology,
        },
        "containers": [
            _container(
                cfg,
                "portatrain",
                _script(cfg, launch_env, torchrun, overrides),
                _resources(cfg, TPU_RESOURCE, chips_per_host),
                env,
            )
        ],
        "volumes": _volumes(cfg),
    }
    manifest = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": launch.namespace,
            "labels": {"app.kubernetes.io/name": "portatrain", "portatrain/recipe": str(cfg.recipe)},
            # One slice per node pool: no two jobs share the slice's hosts.
            "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
        },
        "spec": {
            "failurePolicy": {
                "maxRestarts": int(launch.max_restarts),
                # An evicted pod (preemption, maintenance) restarts everything without using up a restart:
                # JobSet's own pattern, site/static/examples/failure-policy/host-maintenance-event-model.yaml.
                "rules": [
                    {
                        "name": "disruption",
                        "action": "RestartJobSetAndIgnoreMaxRestarts",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                    }
                ],
            },
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
                            "backoffLimit": 0,  # a failed pod fails the Job; the JobSet restarts all
                            "podFailurePolicy": {
                                "rules": [
                                    {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]}
                                ]
                            },
                            "template": {"spec": pod_spec},
                        }
                    },
                }
            ],
        },
    }
    return _dump(manifest, cfg, "JobSet")


def render_pytorchjob(cfg: Any, overrides: Sequence[str], name: str) -> str:
    """A Kubeflow PyTorchJob running ``portatrain <overrides>`` on ``nodes`` GPU or Trainium hosts."""
    launch = cfg.launch
    torchrun = [
        "torchrun",
        # Set by the training operator in every pod: master 0, workers 1.. (static rendezvous).
        '--nnodes="$PET_NNODES"',
        '--node-rank="$PET_NODE_RANK"',
        f"--nproc-per-node={launch.procs_per_node}",
        '--master-addr="$PET_MASTER_ADDR"',
        '--master-port="$PET_MASTER_PORT"',
        f"--rdzv-id={name}",
        f"--shutdown-timeout={_grace(cfg)}",
    ]
    if cfg.device.type == "neuron":
        resources = _resources(
            cfg, PYTORCHJOB_RESOURCES["neuron"], launch.procs_per_node // NEURON_CORES_PER_CHIP
        )
    else:
        resources = _resources(cfg, PYTORCHJOB_RESOURCES["cuda"], launch.procs_per_node)
    container = _container(cfg, "pytorch", _script(cfg, [], torchrun, overrides), resources, {})

    def replica(count: int) -> dict[str, Any]:
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {
                "spec": {
                    "terminationGracePeriodSeconds": _grace(cfg) + 30,
                    # The training operator finds the container by this name.
                    "containers": [container],
                    "volumes": _volumes(cfg),
                }
            },
        }

    specs = {"Master": replica(1)}
    if launch.nodes > 1:
        specs["Worker"] = replica(launch.nodes - 1)
    manifest = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {
            "name": name,
            "namespace": launch.namespace,
            "labels": {"app.kubernetes.io/name": "portatrain", "portatrain/recipe": str(cfg.recipe)},
        },
        "spec": {
            "nprocPerNode": str(launch.procs_per_node),
            "runPolicy": {
                "backoffLimit": int(launch.max_restarts),
                "cleanPodPolicy": "None",
            },
            "pytorchReplicaSpecs": specs,
        },
    }
    return _dump(manifest, cfg, "PyTorchJob")


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # repeated blocks written out, no &id001 anchors
        return True


def _dump(manifest: dict[str, Any], cfg: Any, kind: str) -> str:
    name = manifest["metadata"]["name"]
    header = (
        f"# portatrain {kind} {name}: {describe_job(cfg)}.\n"
        f"# Run directory: {run_dir_for(cfg, name)} on volume claim "
        f"{cfg.launch.volume_claim}; restarts resume from its newest checkpoint.\n"
        "# Rendered by `portatrain render`; submit with `kubectl create -f FILE` (a new name per rendering).\n"
    )
    return header + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def group_name(name: str, replica_id: int) -> str:
    """The PyTorchJob of replica group ``replica_id`` (fault tolerance)."""
    return f"{name}-g{replica_id}"


def lighthouse_name(name: str) -> str:
    return f"{name}-lighthouse"


def render_replica_groups(cfg: Any, overrides: Sequence[str], name: str) -> str:
    """Fault tolerance: torchft's lighthouse (a Deployment and its Service) and one PyTorchJob per
    replica group, each its own restartable unit."""
    from portatrain.fault_tolerance import LIGHTHOUSE_PORT

    launch, ft = cfg.launch, cfg.fault_tolerance
    lighthouse = lighthouse_name(name)
    labels = {"app.kubernetes.io/name": "portatrain", "portatrain/recipe": str(cfg.recipe)}
    selector = {"portatrain/lighthouse": lighthouse}
    lighthouse_documents = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": lighthouse, "namespace": launch.namespace, "labels": labels},
            "spec": {"selector": selector, "ports": [{"name": "lighthouse", "port": LIGHTHOUSE_PORT}]},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": lighthouse, "namespace": launch.namespace, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {"labels": {**labels, **selector}},
                    "spec": {
                        "containers": [
                            {
                                "name": "lighthouse",
                                "image": launch.image,
                                "command": [
                                    "bash",
                                    "-c",
                                    " && ".join(
                                        [
                                            *launch.setup,
                                            f"exec python -m portatrain lighthouse --port={LIGHTHOUSE_PORT} "
                                            f"--min-replicas={ft.min_replicas}",
                                        ]
                                    ),
                                ],
                                "ports": [{"containerPort": LIGHTHOUSE_PORT, "name": "lighthouse"}],
                                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                            }
                        ]
                    },
                },
            },
        },
    ]
    # The user's own lighthouse (fault_tolerance.lighthouse) replaces the rendered one.
    documents = [] if ft.lighthouse else lighthouse_documents
    address = [] if ft.lighthouse else [f"fault_tolerance.lighthouse=http://{lighthouse}:{LIGHTHOUSE_PORT}"]
    overrides = [o for o in overrides if not o.lstrip("+~").startswith("fault_tolerance.replica_id=")]
    for replica_id in range(ft.group_size):
        group = [*overrides, f"fault_tolerance.replica_id={replica_id}", *address]
        documents.append(yaml.safe_load(render_pytorchjob(cfg, group, group_name(name, replica_id))))
    header = (
        f"# portatrain fault-tolerant job {name}: {describe_job(cfg)}, as {ft.group_size} replica groups,\n"
        f"# one PyTorchJob each ({group_name(name, 0)} ...), restarted alone while the others train on, and\n"
        f"# torchft's lighthouse ({lighthouse}). Run directory: {run_dir_for(cfg, name)} on volume claim\n"
        f"# {launch.volume_claim}. Rendered by `portatrain render`; submit with `kubectl create -f FILE`.\n"
    )
    return header + "---\n".join(
        yaml.dump(d, Dumper=_Dumper, sort_keys=False, default_flow_style=False) for d in documents
    )


def render(cfg: Any, overrides: Sequence[str]) -> RenderedJob:
    """The JobSet or PyTorchJob for ``cfg`` (``launch.scheduler``), with a fresh name."""
    name = unique_job_name(cfg.launch.job_name or f"portatrain-{cfg.recipe}")
    run_dir = run_dir_for(cfg, name)
    args = job_overrides(overrides, run_dir=run_dir)
    if cfg.fault_tolerance.enabled:
        text = render_replica_groups(cfg, args, name)
    elif cfg.launch.scheduler == "jobset":
        text = render_jobset(cfg, args, name)
    else:
        text = render_pytorchjob(cfg, args, name)
    return RenderedJob(text, "job.yaml", ("kubectl", "create", "-f"), name=name, run_dir=run_dir)


def follow_command(cfg: Any, name: str) -> str:
    """``kubectl logs -f`` of rank 0's pod (pod index 0: the JobSet's first pod, the PyTorchJob master)."""
    ns = shlex.quote(cfg.launch.namespace)
    if cfg.fault_tolerance.enabled:  # replica group 0's master
        name = group_name(name, 0)
    if cfg.launch.scheduler == "jobset":
        selector = f"jobset.sigs.k8s.io/jobset-name={name},batch.kubernetes.io/job-completion-index=0"
        return f"kubectl logs -f -n {ns} -l {selector}"
    return f"kubectl logs -f -n {ns} {name}-master-0"


def submit(cfg: Any, job: RenderedJob) -> SubmittedJob:
    """``kubectl create -f`` the job (from ``launch.output`` when set, else stdin)."""
    from portatrain.launch.job import SubmitError

    output = cfg.launch.output
    if output:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(job.text)
        argv, text_input = ["kubectl", "create", "-f", str(path)], None
    else:
        argv, text_input = ["kubectl", "create", "-f", "-"], job.text
    result = subprocess.run(argv, input=text_input, text=True, capture_output=True)
    if result.returncode != 0:
        raise SubmitError(
            f"the cluster rejected the job (`{shlex.join(argv)}` exited with {result.returncode}): "
            f"{result.stderr.strip() or 'no reason given'}"
        )
    claim = cfg.launch.volume_claim
    return SubmittedJob(job.name, f"{job.run_dir} (volume claim {claim})", follow_command(cfg, job.name))
