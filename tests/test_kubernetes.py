"""The rendered JobSet and PyTorchJob: valid against the published CRD schemas, and built to survive a
real cluster (shared RWX volume with the run directory, restarts with resume, unique valid names,
node rank from the pod index, resource requests, EFA, TPU launch step and selector checks).

The CRDs are fixtures (``tests/fixtures/crds/*.yaml.gz``; each file's first lines name its source
repository, path, tag and commit): JobSet v0.12.0 and main (v0.13.0-devel), Kubeflow PyTorchJob v1.9.0.
Every manifest rendered here is checked against them by :func:`validate`, a small structural
OpenAPI-v3 validator that rejects unknown fields the way the API server prunes or refuses them.
"""

from __future__ import annotations

import gzip
import os
import random
import re
import stat
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from portatrain.errors import ConfigError
from portatrain.launch import render_job
from portatrain.launch.kubernetes import is_dns1035, unique_job_name
from tests.conftest import compose_config, run_cli

CRDS = Path(__file__).parent / "fixtures" / "crds"
SCHEMAS = {
    "JobSet": ["jobset-v0.12.0.yaml.gz", "jobset-v0.13.0-devel.yaml.gz"],
    "PyTorchJob": ["pytorchjob-v1.9.0.yaml.gz"],
}


# -- a structural OpenAPI v3 validator (the subset CRDs use) -------------------------------------------
@cache
def crd_schema(fixture: str, version: str) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with gzip.open(CRDS / fixture, "rt") as f:
        crd = yaml.load(f, Loader=loader)
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            return served["schema"]["openAPIV3Schema"]
    raise KeyError(f"{fixture} serves no version {version}")


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "number": (int, float)}


def validate(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Every violation of ``schema`` in ``value``: unknown fields, wrong types, missing required
    fields, enum, pattern and bound violations. CEL rules (``x-kubernetes-validations``) are not run."""
    errors: list[str] = []
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            errors.append(f"{path}: {value!r} is neither an integer nor a string")
        return errors
    kind = schema.get("type")
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{path}: {value!r} is not an integer"]
    elif kind in _TYPES and (
        not isinstance(value, _TYPES[kind]) or (kind == "number" and isinstance(value, bool))
    ):
        return [f"{path}: {value!r} is not of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, int) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > {schema['maximum']}")
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        for i, item in enumerate(value):
            errors += validate(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: required field {key!r} is missing")
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if path == "" and key in ("apiVersion", "kind", "metadata"):
                continue  # ObjectMeta is not in a CRD's schema; names are checked by the tests
            if key in properties:
                errors += validate(item, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                errors += validate(item, extra, f"{path}.{key}")
            elif extra is True or schema.get("x-kubernetes-preserve-unknown-fields"):
                continue
            else:
                errors.append(f"{path}.{key}: unknown field")
    return errors


def _check_against_crds(manifest: dict[str, Any]) -> None:
    version = manifest["apiVersion"].split("/")[1]
    for fixture in SCHEMAS[manifest["kind"]]:
        errors = validate(manifest, crd_schema(fixture, version))
        assert not errors, f"{fixture}:\n  " + "\n  ".join(errors)


def test_the_validator_rejects_unknown_fields_and_wrong_types() -> None:
    schema = crd_schema("pytorchjob-v1.9.0.yaml.gz", "v1")
    bad = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "x"},
        "spec": {
            "runPolicy": {"backofLimit": 3, "cleanPodPolicy": 1},
            "pytorchReplicaSpecs": {
                "Master": {"replicas": "one", "template": {"spec": {"containers": [{}]}}}
            },
        },
    }
    errors = "\n".join(validate(bad, schema))
    assert ".spec.runPolicy.backofLimit: unknown field" in errors
    assert ".spec.runPolicy.cleanPodPolicy: 1 is not of type string" in errors
    assert ".spec.pytorchReplicaSpecs.Master.replicas: 'one' is not an integer" in errors
    assert "containers[0]: required field 'name' is missing" in errors


# -- rendering ----------------------------------------------------------------------------------------
def _cfg(overrides: list[str], **launch: Any):
    cfg = compose_config(overrides)
    launch.setdefault("volume_claim", "training-runs")
    for key, value in launch.items():
        cfg.launch[key] = value
    return cfg


def _render(overrides: list[str], **launch: Any) -> tuple[dict[str, Any], str]:
    job = render_job(_cfg(overrides, **launch), overrides)
    manifest = yaml.safe_load(job.text)
    _check_against_crds(manifest)
    return manifest, job.text


TRAINIUM = [
    "recipe=llama8b",
    "device=neuron",
    "parallel.launch.scheduler=pytorchjob",
    "parallel.launch.nodes=4",
    "parallel.launch.procs_per_node=64",
    "parallel.launch.image=registry.example/portatrain:1",
    "+parallel.launch.env.NEURON_RT_LOG_LEVEL=ERROR",
]
TPU = [
    "recipe=llama8b",
    "device=tpu",
    "parallel.launch.scheduler=jobset",
    "parallel.launch.nodes=2",
    "parallel.launch.procs_per_node=4",
    "parallel.launch.tpu_topology=2x2x2",
    "parallel.launch.image=img:1",
    'parallel.launch.setup=["pip install -e ."]',
]


def test_pytorchjob_for_trainium_survives_a_cluster() -> None:
    manifest, text = _render(TRAINIUM)
    assert (manifest["apiVersion"], manifest["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    name = manifest["metadata"]["name"]
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 3)
    assert manifest["spec"]["nprocPerNode"] == "64"
    # Restarts with resume.
    assert manifest["spec"]["runPolicy"]["backoffLimit"] == 3
    assert {s["restartPolicy"] for s in specs.values()} == {"OnFailure"}
    pod = specs["Worker"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 180 + 30
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"  # the operator looks for this name ...
    assert container["ports"] == [{"containerPort": 29500, "name": "pytorchjob-port"}]  # ... and port
    # 64 ranks = 16 Trainium2 chips; all 16 EFA interfaces of a trn2.48xlarge; CPU/memory requests.
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "32Gi", "aws.amazon.com/neuron": 16, "vpc.amazonaws.com/efa": 16},
        "limits": {"aws.amazon.com/neuron": 16, "vpc.amazonaws.com/efa": 16},
    }
    assert {"name": "NEURON_RT_LOG_LEVEL", "value": "ERROR"} in container["env"]
    # The run directory on the shared ReadWriteMany claim, named after the job.
    assert {"name": "run-dir", "persistentVolumeClaim": {"claimName": "training-runs"}} in pod["volumes"]
    assert {"name": "run-dir", "mountPath": "/mnt/portatrain"} in container["volumeMounts"]
    script = container["command"][2]
    assert container["command"][:2] == ["bash", "-c"] and script.startswith("exec torchrun ")
    # Node rank from the operator's pod rank (master 0): a static rendezvous.
    for arg in ('--nnodes="$PET_NNODES"', '--node-rank="$PET_NODE_RANK"', '--master-addr="$PET_MASTER_ADDR"'):
        assert f" {arg} " in script
    assert "--rdzv-backend" not in script and " --shutdown-timeout=180 " in script
    assert script.endswith(
        f"-m portatrain recipe=llama8b device=neuron checkpoint.resume=auto "
        f"run_dir=/mnt/portatrain/runs/llama8b/{name}"
    )
    assert f"# Run directory: /mnt/portatrain/runs/llama8b/{name} on volume claim training-runs" in text


def test_pytorchjob_for_gpus_requests_gpus_and_says_whether_it_has_efa() -> None:
    base = ["device=cuda", "parallel.launch.scheduler=pytorchjob", "parallel.launch.procs_per_node=8"]
    manifest, _ = _render([*base, "parallel.launch.image=img:1"])
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master"}  # one node: no workers
    resources = specs["Master"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {"nvidia.com/gpu": 8}
    multi = [*base, "parallel.launch.image=img:1", "parallel.launch.nodes=2"]
    with pytest.raises(ConfigError, match=r"2-node GPU job needs RDMA .* set launch.efa=N"):
        render_job(_cfg(multi), multi)
    manifest, _ = _render(multi, efa=32)
    resources = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0][
        "resources"
    ]
    assert resources["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    manifest, _ = _render(multi, efa=0)  # no EFA on this cluster: said explicitly
    resources = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0][
        "resources"
    ]
    assert resources["limits"] == {"nvidia.com/gpu": 8}


def test_jobset_for_a_tpu_slice_runs_the_torchtpu_launch_step() -> None:
    manifest, _ = _render(TPU)
    assert (manifest["apiVersion"], manifest["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    name = manifest["metadata"]["name"]
    spec = manifest["spec"]
    assert spec["failurePolicy"]["maxRestarts"] == 3
    assert spec["failurePolicy"]["rules"][0]["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    (job,) = spec["replicatedJobs"]
    job_spec = job["template"]["spec"]
    assert (job_spec["parallelism"], job_spec["completions"], job_spec["completionMode"]) == (2, 2, "Indexed")
    assert job_spec["backoffLimit"] == 0
    assert job_spec["podFailurePolicy"]["rules"][0]["onPodConditions"] == [{"type": "DisruptionTarget"}]
    pod = job_spec["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "2x2x2",
    }
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"google.com/tpu": 4}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TPU_WORKER_HOSTNAMES"] == f"{name}-workers-0-0.{name},{name}-workers-0-1.{name}"
    assert (env["TORCH_TPU_DEVICES_PER_HOST"], env["MASTER_PORT"]) == ("4", "29500")
    assert container["ports"] == [{"containerPort": 29500, "name": "rendezvous"}]
    script = container["command"][2]
    # Setup, then TorchTPU's launch step (exported to the workers), then torchrun as the main process.
    setup, torchrun = script.split(" && exec torchrun ")
    assert setup == (
        'pip install -e . && tpu_env=$(python -m torch.tpu.distributed) && set -a && eval "$tpu_env" && set +a'
    )
    assert '--node-rank="$NODE_RANK"' in torchrun and '--master-addr="$MASTER_ADDR"' in torchrun
    assert "--nproc-per-node=4" in torchrun and f"run_dir=/mnt/portatrain/runs/llama8b/{name}" in torchrun


def test_tpu7x_counts_two_devices_per_chip_and_selectors_must_match_the_topology() -> None:
    tpu7x = [o for o in TPU if "procs_per_node" not in o] + ["parallel.launch.procs_per_node=8"]
    tpu7x.append("parallel.launch.tpu_accelerator=tpu7x")
    manifest, _ = _render(tpu7x)
    container = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"google.com/tpu": 4}  # 4 chips = 8 devices per host
    flat = [*TPU, "parallel.launch.tpu_topology=4x4"]  # 2-D topology, v5p selector: inconsistent
    with pytest.raises(ConfigError) as err:
        render_job(_cfg(flat), flat)
    assert "tpu_topology=4x4 is 2-D, but tpu_accelerator=tpu-v5p-slice slices are 3-D" in str(err.value)
    assert "tpu-v5-lite-podslice, tpu-v6e-slice" in str(err.value)
    v6e = [*TPU, "parallel.launch.tpu_topology=4x4", "parallel.launch.tpu_accelerator=tpu-v6e-slice"]
    with pytest.raises(ConfigError, match=r"is 4 host\(s\) x 4 chip\(s\) .* set launch.nodes=4"):
        render_job(_cfg(v6e), v6e)


def test_names_are_unique_valid_and_short() -> None:
    rng = random.Random(0)
    long_name = unique_job_name("portatrain-" + "x" * 80, rng=rng)
    digit_first = unique_job_name("7b-run_2", rng=rng)
    assert len(long_name) <= 45 and is_dns1035(long_name)
    assert digit_first.startswith("pt-7b-run-2-") and is_dns1035(digit_first)
    names = {_render(TRAINIUM)[0]["metadata"]["name"] for _ in range(3)}
    assert len(names) == 3  # a second submission never updates the first job
    for name in names:
        assert is_dns1035(name, 45) and len(f"{name}-workers-0-15-abcde") <= 63


def test_kubernetes_problems_are_reported_together() -> None:
    overrides = [
        "device=cuda",
        "parallel.launch.scheduler=jobset",
        "parallel.launch.nodes=2",
        "parallel.launch.procs_per_node=8",
    ]
    with pytest.raises(ConfigError) as err:
        render_job(_cfg(overrides, volume_claim=None), overrides)
    message = str(err.value)
    assert "needs a container image: set launch.image=" in message
    assert "needs shared storage for its run directory" in message and "volume_claim=CLAIM" in message
    assert "renders a TPU slice, but device=cuda" in message
    assert "is 2 host(s) x 4 chip(s) x 1 device(s) per chip, but nodes=2 and procs_per_node=8" in message


def test_trainium_ranks_are_logical_neuroncores() -> None:
    overrides = [*TRAINIUM[:-3], "parallel.launch.procs_per_node=32", "parallel.launch.image=i:1"]
    manifest, _ = _render(overrides)
    container = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["aws.amazon.com/neuron"] == 8
    bad = [*TRAINIUM[:-3], "parallel.launch.procs_per_node=128", "parallel.launch.image=i:1"]
    with pytest.raises(
        ConfigError, match=r"procs_per_node=128: Trainium runs one process per logical NeuronCore"
    ):
        render_job(_cfg(bad), bad)


def test_submit_creates_the_job_and_prints_name_run_dir_and_log(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(
        '#!/bin/bash\necho "$@" > "$(dirname "$0")/called"\ncat > "$(dirname "$0")/job.yaml"\n'
    )
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = run_cli(["submit", *TRAINIUM, "parallel.launch.volume_claim=training-runs"], cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    name = yaml.safe_load((bin_dir / "job.yaml").read_text())["metadata"]["name"]
    assert (bin_dir / "called").read_text().split() == ["create", "-f", "-"]
    assert out.stdout.splitlines() == [
        f"submitted job {name}",
        f"run directory: /mnt/portatrain/runs/llama8b/{name} (volume claim training-runs)",
        f"follow its log: kubectl logs -f -n default {name}-master-0",
    ]
    assert not (tmp_path / "runs").exists()


def test_submit_without_kubectl_is_one_clear_error(tmp_path: Path) -> None:
    out = run_cli(
        ["submit", "parallel.launch.scheduler=pytorchjob", "device=cuda", "parallel.launch.image=i:1"],
        cwd=tmp_path,
        env={"PATH": os.path.dirname(sys.executable)},
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "portatrain submit: error: " in out.stderr


@pytest.mark.parametrize("scheduler", ["pytorchjob", "jobset"])
def test_secrets_are_read_from_a_kubernetes_secret_never_written(scheduler: str) -> None:
    base = TRAINIUM if scheduler == "pytorchjob" else TPU
    manifest, text = _render([*base, "+parallel.launch.env.HF_TOKEN=hf_sekrit_value"])  # CRD-valid
    assert "hf_sekrit_value" not in text
    ref = {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "portatrain-secrets", "key": "HF_TOKEN"}},
    }
    assert f"{ref}" in f"{manifest}"
