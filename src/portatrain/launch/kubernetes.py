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

Modules: this one names a job, renders it and submits it; ``kubernetes_checks.py`` holds the
hardware tables and the config checks, ``kubernetes_manifests.py`` builds the manifests.

Tested against the published CRD schemas (JobSet v0.12.0 and main, Kubeflow PyTorchJob v1.9.0) in
``tests/test_kubernetes.py``; not run on a real cluster here.
"""

from __future__ import annotations

import random
import re
import shlex
import string
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from portatrain.launch.job import RenderedJob, SubmittedJob, job_overrides
from portatrain.launch.kubernetes_checks import problems as problems
from portatrain.launch.kubernetes_manifests import (
    group_name,
    render_jobset,
    render_pytorchjob,
    render_replica_groups,
    run_dir_for,
)

MAX_NAME = 45
"""JobSet pod names ``<jobset>-<replicated job>-<job index>-<pod index>-<5 random>`` must fit 63."""


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
