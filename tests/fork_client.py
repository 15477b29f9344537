"""The client of ``tests/fork_server.py``: ``python -S tests/fork_client.py -m MODULE ARGS`` (or
``-c CODE ARGS``, or ``SCRIPT ARGS``, after an optional ``-u``) behaves as ``python`` with those
arguments would, served by a fork of the test process's server (see its docstring). Without a server (``PORTATRAIN_FORK_SERVER`` unset or not listening), or
when the server refuses (an import-time variable differs), it ``exec``\\s that real interpreter.

Standard library only and started with ``-S``: its own start-up is ~20 ms."""

import json
import os
import signal
import socket
import struct
import sys
import time

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _real() -> None:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


def _await(path: str, patience_s: float = 60) -> None:
    """Wait while the server is alive but still importing (its socket appears once it listens): a
    fork that comes a few seconds late costs less than a new interpreter's ~5 CPU-s of imports."""
    pid_file = os.path.join(os.path.dirname(path), "pid")
    deadline = time.monotonic() + patience_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        try:
            with open(pid_file) as f:
                os.kill(int(f.read()), 0)
        except (OSError, ValueError):
            return
        time.sleep(0.1)


def main() -> None:
    path = os.environ.get("PORTATRAIN_FORK_SERVER")
    if not path or os.environ.get("PORTATRAIN_TEST_NO_FORK") == "1":
        _real()
    _await(path)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # gone, or still importing after a minute
        _real()
    request = json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(conn, [struct.pack("!Q", len(request)) + request], [0, 1, 2])
    replies = conn.makefile("rb")
    first = json.loads(replies.readline() or b'{"refused": "the server ended"}')
    if "refused" in first:
        conn.close()
        _real()
    pid = first["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _frame: os.kill(pid, sig))
    line = replies.readline()
    status = json.loads(line)["status"] if line else -signal.SIGKILL
    if status < 0:  # killed by a signal: end by the same one, as the process did
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        sys.stdout.flush()
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    main()
