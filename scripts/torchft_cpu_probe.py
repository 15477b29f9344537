"""Does torchft's fault tolerance work on this machine (CPU, gloo)? A probe, not portatrain's
integration: two replica groups of one process each train a small MLP, averaging gradients through
``torchft.Manager`` (a gloo ``ProcessGroupGloo`` reconfigured at every quorum) under one
``LighthouseServer``. Replica group 1 is SIGKILLed at a random step and restarted; group 0 must keep
stepping without a restart (quorum of one), the restarted group must rejoin by live recovery (it
fetches group 0's state over HTTP and jumps to its step), and both must end with bitwise-identical
weights.

    OMP_NUM_THREADS=1 python scripts/torchft_cpu_probe.py            # ~3-4 minutes on 2 busy cores
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import subprocess
import sys
import time
from datetime import timedelta


def replica(group: int, steps: int, kill_at: int, store_port: int) -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    store = TCPStore("localhost", store_port, is_master=True, wait_for_workers=False)  # the group's own
    assert store is not None  # kept referenced: the store server lives as long as the object
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    timeout = timedelta(seconds=10)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"group{group}",
        store_addr="localhost",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        timeout=timeout,
        quorum_timeout=timeout,
    )
    optimizer = OptimizerWrapper(manager, inner)
    data = torch.Generator().manual_seed(group)
    while manager.current_step() < steps:
        optimizer.zero_grad()  # starts the quorum (a restarted group recovers here)
        model(torch.randn(8, 16, generator=data)).pow(2).mean().backward()
        for p in model.parameters():
            manager.allreduce(p.grad).wait()  # the average over the groups in the quorum
        optimizer.step()  # commits only if every group's step succeeded
        step = manager.current_step()
        print(f"group{group} step {step} participants {manager.num_participants()}", flush=True)
        if kill_at and step >= kill_at:
            os.kill(os.getpid(), 9)
        time.sleep(0.5)  # a step's compute: time enough (~70 s) for the killed group to come back
    weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"group{group} done step {manager.current_step()} weights {weights.hexdigest()}", flush=True)
    manager.shutdown()


def main() -> None:
    from torchft.coordination import LighthouseServer

    steps, kill_at = 150, random.Random().randint(5, 20)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address(), "OMP_NUM_THREADS": "1"}

    def start(group: int, kill: int, port: int) -> subprocess.Popen:
        args = [sys.executable, __file__, "replica", str(group), str(steps), str(kill), str(port)]
        return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    healthy, doomed = start(0, 0, 29611), start(1, kill_at, 29622)
    first = doomed.communicate()[0]
    print(f"group1 killed (status {doomed.returncode}) after: {first.strip().splitlines()[-1]}", flush=True)
    restarted = start(1, 0, 29633)
    outputs = [p.communicate()[0] for p in (healthy, restarted)]
    lighthouse.shutdown()
    survivor_alone = [int(m) for m in re.findall(r"group0 step (\d+) participants 1", outputs[0])]
    rejoined = re.findall(r"group1 step (\d+) participants 2", outputs[1])
    weights = [re.search(r"weights (\w+)", out).group(1) for out in outputs]
    print(f"group0 stepped alone (no restart) through steps {survivor_alone[:1]}..{survivor_alone[-1:]}")
    print(f"restarted group1's first step after rejoining: {rejoined[:1]} (live recovery, not step 1)")
    print(f"weights identical: {weights[0] == weights[1]} ({weights[0][:16]} / {weights[1][:16]})")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "replica":
        replica(*(int(a) for a in sys.argv[2:6]))
    else:
        main()
