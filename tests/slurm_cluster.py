"""A real SLURM cluster on this machine, for the tests: munged, slurmctld and one slurmd per node.

``SlurmCluster.start(nodes=1)`` installs Debian's ``slurm-wlm`` and ``munge`` packages if they are
missing (as root, with ``apt-get``), writes a private ``slurm.conf`` and munge key into a temporary
directory, and starts the daemons on free ports with a private munge socket, so nothing of the
machine's own configuration is read or changed. ``stop()`` stops exactly the daemons it started.
Clients find the cluster through ``SLURM_CONF`` (``cluster.env``).

The configuration is the smallest that runs real jobs in a container: ``select/cons_tres``, one
partition, ``proctrack/linuxproc`` (tracks a step's processes through /proc, no cgroups needed) and
``task/none``. Several nodes share this host: each ``slurmd -N NAME`` listens on its own port
(``NodeName=... Port=...``), which Debian's 22.05 build accepts (a second ``NodeName=localhost`` was
refused: "Duplicated NodeHostName"). The first node is named after this host, the others ``node2``...;
all have ``NodeAddr=127.0.0.1``, which is what the sbatch script reads for the rendezvous host.

Where ``apt-get`` is missing or we are not root, :func:`install` says so and the tests skip;
``PORTATRAIN_REQUIRE_SLURM=1`` turns that skip into a failure (for CI, where SLURM must run).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")


def _missing() -> list[str]:
    return [tool for tool in (*DAEMONS, *CLIENTS) if shutil.which(tool) is None]


def _apt_get(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=600)


def install() -> str | None:
    """Install the packages if a daemon or client is missing; return why SLURM cannot run, or None."""
    if not _missing():
        return None
    if os.geteuid() != 0:
        return f"SLURM is not installed ({', '.join(_missing())} missing) and installing it needs root"
    if shutil.which("apt-get") is None:
        return f"SLURM is not installed ({', '.join(_missing())} missing) and there is no apt-get"
    install_args = ("install", "-y", "--no-install-recommends", *PACKAGES)
    result = _apt_get(*install_args)
    if result.returncode != 0:  # a fresh machine may have no package lists yet
        _apt_get("update")
        result = _apt_get(*install_args)
    if result.returncode != 0 or _missing():
        return f"`apt-get install {' '.join(PACKAGES)}` failed: {result.stderr.strip()[-500:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_shim(bin_dir: Path) -> Path:
    """Write ``BIN_DIR/torchrun``, for a job script that finds ``torchrun`` on its ``PATH``: torchrun
    with its agent and its workers forks of the test process's fork server (``tests/fork_server.py``),
    as ``tests.helpers.torchrun_command`` launches them. The workers' ``-m MODULE ARGS`` becomes
    ``--no-python <fork client> -u -m MODULE ARGS`` (``-u``: what torchrun itself gives a worker)."""
    from tests.helpers import python

    shim = bin_dir / "torchrun"
    shim.write_text(
        "#!/bin/bash\n"
        "args=()\n"
        "while (($#)); do\n"
        f'    if [[ $1 == -m ]]; then args+=(--no-python {shlex.join(python())} -u "$@"); break; fi\n'
        '    args+=("$1"); shift\n'
        "done\n"
        f'exec {shlex.join(python("-m", "torch.distributed.run"))} "${{args[@]}}"\n'
    )
    shim.chmod(0o755)
    return shim


RELEASE_AFTER_S = 8.0
"""How long a requeued job waits before ``wait_for`` releases it (SLURM itself waits ~2 minutes)."""


class SlurmCluster:
    """One slurmctld and ``nodes`` slurmd daemons on this host (see the module docstring)."""

    def __init__(self, nodes: int = 1, cpus_per_node: int | None = None) -> None:
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node or max(1, (os.cpu_count() or 2) // nodes)
        # Short path: munge's socket path must fit a sockaddr_un (108 bytes).
        self.root = Path(tempfile.mkdtemp(prefix="pt-slurm-"))
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.sock"
        self.node_names = [socket.gethostname(), *(f"node{i}" for i in range(2, nodes + 1))]
        self._pidfiles: list[Path] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment of a client of this cluster (``sbatch``, ``squeue`` ...)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        r = self.root
        for sub in ("munge", "state", "spool", "log", *(f"spool/{name}" for name in self.node_names)):
            (r / sub).mkdir(mode=0o700, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ports = [_free_port() for _ in range(self.nodes + 1)]
        host = socket.gethostname()
        lines = [
            "ClusterName=portatrain-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"SlurmctldPort={ports[0]}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # nodes may claim more than the host has
            "JobRequeue=1",
            "KillWait=30",  # SLURM's default: SIGTERM, then this long to save, then SIGKILL
        ]
        for name, port in zip(self.node_names, ports[1:]):
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={self.cpus_per_node} RealMemory=2000 State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=debug Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, argv: list[str], pidfile: Path) -> None:
        self._pidfiles.append(pidfile)
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}\n{self.logs()}")

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Start munged, slurmctld and the slurmds; return once every node is idle."""
        self._write_config()
        m = self.root / "munge"
        self._spawn(
            [
                "munged",
                "--force",  # the key and socket live under /tmp, whose parents munge finds too open
                f"--socket={self.socket}",
                f"--key-file={m / 'munge.key'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--log-file={m / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
            m / "munged.pid",
        )
        self._spawn(["slurmctld", "-i", "-f", str(self.conf)], self.root / "slurmctld.pid")
        for name in self.node_names:
            self._spawn(["slurmd", "-N", name, "-f", str(self.conf)], self.root / f"slurmd-{name}.pid")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
            if len(states) == self.nodes and all(s == "idle" for s in states):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"SLURM nodes did not become idle in {timeout:.0f} s\n{self.logs()}")

    def stop(self) -> None:
        """Cancel every job, stop the daemons this cluster started, delete its directory."""
        if self.conf.exists():
            self.run("scancel", "--full", "-u", "root", check=False)
            for _ in range(60):  # let the jobs' processes exit before their slurmd goes
                if not self.run("squeue", "-h", check=False).stdout.strip():
                    break
                time.sleep(0.5)
        for pidfile in reversed(self._pidfiles):  # slurmds, then slurmctld, then munged
            try:
                pid = int(pidfile.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- clients ------------------------------------------------------------------------------
    def run(
        self, *argv: str, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """Run a SLURM client against this cluster (``env``: the whole environment, default ``self.env``)."""
        result = subprocess.run(argv, env=env or self.env, capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``Restarts``, ``Reason`` ...); {} once purged."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        fields = {}
        for token in out.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def wait_for(
        self, job_id: str, states: set[str], timeout: float, *, release: tuple[str, ...] = ("StartTime=now",)
    ) -> dict:
        """Poll until the job's state is one of ``states``; return its fields.

        A requeued job waits about two minutes before it may start again (SLURM 22.05 sets its
        ``BeginTime``; observed: Reason=BeginTime). While it waits, ``scontrol update`` applies
        ``release`` to it -- by default ``StartTime=now``, standing in for that wait so the tests stay
        fast; a test may add e.g. ``TimeLimit=5`` for the requeued run. ``release=()`` leaves it.
        """
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        waiting_since = None
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if release and fields.get("JobState") == "PENDING" and fields.get("Reason") == "BeginTime":
                # Not at once: slurmd keeps the killed run's credential revoked for a moment, and a
                # restart inside that moment fails ("Job credential revoked", seen on a loaded machine).
                waiting_since = waiting_since or time.monotonic()
                if time.monotonic() - waiting_since >= RELEASE_AFTER_S:
                    self.run("scontrol", "update", f"JobId={job_id}", *release, check=False)
            else:
                waiting_since = None
            time.sleep(0.5)
        raise TimeoutError(
            f"job {job_id} not in {sorted(states)} after {timeout:.0f} s: {fields}\n{self.logs()}"
        )

    def logs(self, lines: int = 30) -> str:
        """The tail of every daemon log, for failure messages."""
        out = []
        for log in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)
