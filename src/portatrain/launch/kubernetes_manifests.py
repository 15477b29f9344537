"""The Kubernetes manifests of a run: a JobSet for a TPU slice, a PyTorchJob for GPU or Trainium
nodes, and, with fault tolerance, one PyTorchJob per replica group beside torchft's lighthouse.

Built from a config that :func:`portatrain.launch.kubernetes_checks.problems` passed; the pod's
parts (resources, container, secrets from a Secret, the shared volume, the launch script) are shared
by every kind. ``portatrain.launch.kubernetes``'s docstring says why each field is what it is.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

import yaml

from portatrain.launch.job import describe_job
from portatrain.launch.kubernetes_checks import (
    EFA_RESOURCE,
    NEURON_CORES_PER_CHIP,
    PYTORCHJOB_RESOURCES,
    TPU_RESOURCE,
    TRN2_EFA_INTERFACES,
    tpu_layout,
)
from portatrain.redact import is_secret

# The training operator reads MASTER_PORT from the container port of this name (v1.9.0,
# pkg/apis/kubeflow.org/v1/pytorch_types.go PyTorchJobDefaultPortName).
_PORT_NAMES = {"pytorchjob": "pytorchjob-port", "jobset": "rendezvous"}
_RUN_VOLUME = "run-dir"


def run_dir_for(cfg: Any, name: str) -> str:
    """The run directory of job ``name``: on the shared volume, named after the job."""
    mount = str(cfg.launch.volume_mount).rstrip("/")
    return f"{mount}/runs/{cfg.recipe}/{name}"


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


def _tpu_pod_spec(cfg: Any, overrides: Sequence[str], name: str) -> dict[str, Any]:
    """The pod of one TPU host: TorchTPU's launch step, then torchrun with the node rank it derives."""
    launch = cfg.launch
    _, chips_per_host, _ = tpu_layout(launch.tpu_accelerator, launch.tpu_topology)  # type: ignore[misc]
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
    return {
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


def render_jobset(cfg: Any, overrides: Sequence[str], name: str) -> str:
    """A JobSet running ``portatrain <overrides>`` on a TPU slice of ``nodes`` hosts."""
    launch = cfg.launch
    pod_spec = _tpu_pod_spec(cfg, overrides, name)
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
