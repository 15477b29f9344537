"""``portatrain lighthouse``: start torchft's lighthouse, which forms the quorum of replica groups each
step of a run with ``fault_tolerance.enabled=true`` (``portatrain.fault_tolerance``). An argument
command: no Hydra config.

It serves until interrupted (Ctrl-C, SIGTERM) and prints the address the replica groups pass as
``fault_tolerance.lighthouse``. A SLURM job rendered with fault tolerance runs it as a step of its
own; a Kubernetes one as a Deployment behind a Service. torchft ships the same server as
``torchft_lighthouse`` (https://github.com/pytorch/torchft).
"""

from __future__ import annotations

import argparse
import signal
import threading

from portatrain.fault_tolerance import LIGHTHOUSE_PORT, import_torchft

HYDRA = False
EXAMPLE = "portatrain lighthouse --port 29510 --min-replicas 1"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="portatrain lighthouse",
        description="Serve torchft's lighthouse until interrupted; runs name it in fault_tolerance.lighthouse.",
    )
    p.add_argument(
        "--port",
        type=int,
        default=LIGHTHOUSE_PORT,
        help=f"TCP port to serve on (0: any free one) [{LIGHTHOUSE_PORT}]",
    )
    p.add_argument("--bind", default="[::]", help="address to bind [[::], every interface]")
    p.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="replica groups a quorum needs (fault_tolerance.min_replicas of the run) [1]",
    )
    p.add_argument(
        "--join-timeout-ms",
        type=int,
        default=1000,
        help="how long a quorum waits for known replica groups that have not asked yet [1000]",
    )
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="a replica group silent this long is dropped from the next quorum [5000]",
    )
    p.add_argument("--quorum-tick-ms", type=int, default=100, help="how often a quorum is tried [100]")
    return p


def main(argv: list[str]) -> int:
    from portatrain.errors import UserError

    args = parser().parse_args(argv)
    if args.min_replicas < 1:
        raise UserError(f"--min-replicas={args.min_replicas} must be >= 1 (replica groups a quorum needs)")
    if not 0 <= args.port < 65536:
        raise UserError(f"--port={args.port} is not a TCP port (0..65535; 0 picks a free one)")
    import os

    # torchft's Rust server logs every quorum (each step of the run) at INFO; RUST_LOG=info shows them.
    os.environ.setdefault("RUST_LOG", "warn")
    import_torchft()  # one line saying how to install it, if it is missing
    from torchft.coordination import LighthouseServer

    try:
        server = LighthouseServer(
            bind=f"{args.bind}:{args.port}",
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except Exception as exc:  # torchft's Rust server: a taken port is a RuntimeError
        raise UserError(
            f"lighthouse: cannot serve on {args.bind}:{args.port} ({exc}); choose another --port"
        ) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"lighthouse serving at {server.address()} (fault_tolerance.lighthouse={server.address()})",
        flush=True,
    )
    stop.wait()
    server.shutdown()
    return 0
