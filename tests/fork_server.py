"""A fork server for the suite: the processes the tests start (``python -m portatrain``, ``torchrun``'s
agent and its workers, ``tests/launch_runs.py``) without paying the interpreter's start-up each time.

Why: measured on the suite's 2-core machine, a ``python -m portatrain`` process spends ~5 of its ~7
CPU seconds importing torch, Hydra and portatrain before it reads its first argument; a two-process
``torchrun`` launch pays that three times (agent and two workers). The suite starts several hundred
such processes. This server imports once, then serves each process from a ``fork()`` of itself
(measured: a 4-step CLI run uses ~1 CPU-s forked against ~7 as a new interpreter).

How: one server per test process (``tests/conftest.py`` starts it and names its socket in
``PORTATRAIN_FORK_SERVER``). ``tests/fork_client.py`` stands in for ``python``: started as
``python -S tests/fork_client.py -m MODULE ARGS`` (or ``-c CODE ARGS``, or ``SCRIPT ARGS``, each after an
optional ``-u``), it connects, hands over its
argument list, working directory, environment and its stdin, stdout and stderr (``SCM_RIGHTS``), and
the server forks a child that becomes that process: its own session, that directory, environment and
streams, ``sys.argv`` and ``sys.path[0]`` as ``python`` sets them, fresh ``random`` and numpy seeds,
the module or script run as ``__main__``, and Python's exit sequence (non-daemon threads joined,
``atexit`` handlers, streams flushed). The client forwards the signals it receives to the child and
ends with the child's status (the same signal if it was killed); if the client dies, the server kills
the child, as a process dies with its own interpreter.

What a fork cannot give, and the server refuses (the client then ``exec``\\s a real interpreter):
another interpreter option than ``-u`` (``-X``, ``-W``, a script on stdin ...), and an environment
that differs from the server's in a variable read while a library loads -- the interpreter's ``PYTHON*`` (``PYTHONPATH`` excepted when it names the same torch and portatrain: the
child's ``sys.path`` follows it), the OpenMP and BLAS runtimes' ``OMP_*``/``MKL_*``/``OPENBLAS_*``,
``ATEN_CPU_CAPABILITY``, ``TORCH_*``/``TORCHINDUCTOR_*``/``TORCHDYNAMO_*``/``PYTORCH_*``. One
difference remains: forked processes share the server's string-hash seed, where new interpreters
each draw one (``PYTHONHASHSEED``), so set iteration order agrees across ranks here; that can hide a
rank-dependent ordering bug, never invent a failure. ``PORTATRAIN_TEST_NO_FORK=1`` runs the suite
with new interpreters only.

Fork safety: the server only imports, never runs an operator, and runs with ``OMP_NUM_THREADS=1``
(numpy's OpenBLAS starts a thread pool otherwise), so it has one thread when it forks.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import traceback
import types

# What `python -m portatrain` imports for any command that builds a model (`python -X importtime`):
# torch, DCP, dynamo (constructing on the meta device imports it through torch's reference ops),
# the CLI with Hydra, the model registry, the trainer; the launcher for torchrun's agent.
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.run",
    "torch._dynamo",
    "portatrain.cli",
    "portatrain.models",
    "portatrain.trainer",
    "portatrain.validate",
)
IMPORT_TIME_ENV = (
    "PYTHON",
    "LD_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "ATEN_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "TORCHDYNAMO_",
    "PYTORCH_",
)
# Read when used: torchrun sets TORCH_NCCL_* (only NCCL's process group reads it); inductor reads its
# cache directory at each compilation (portatrain.compile.cache sets it at run time, as a test may).
READ_LATER = ("PYTHONPATH", "TORCH_NCCL_", "TORCHINDUCTOR_CACHE_DIR")
PRELOADED_PACKAGES = ("torch", "portatrain")


def _refusal(argv: list[str], env: dict[str, str]) -> str | None:
    """Why a fork of this server is not the process ``argv`` and ``env`` describe, or None when it is."""
    _, argv = _options(argv)
    served = argv and (argv[0] in ("-m", "-c") and len(argv) > 1 or not argv[0].startswith("-"))
    if not served:
        return f"python {' '.join(argv[:1])} is not served"
    for key in set(env) | set(os.environ):
        if (
            env.get(key) == os.environ.get(key)
            or not key.startswith(IMPORT_TIME_ENV)
            or key.startswith(READ_LATER)
        ):
            continue
        return f"{key} differs"
    for entry in filter(None, env.get("PYTHONPATH", "").split(os.pathsep)):
        for name in PRELOADED_PACKAGES:
            there = os.path.join(entry, name)
            loaded = os.path.dirname(sys.modules[name].__file__)
            if os.path.isdir(there) and os.path.realpath(there) != os.path.realpath(loaded):
                return f"PYTHONPATH holds another {name}"
    return None


def _options(argv: list[str]) -> tuple[bool, list[str]]:
    """``python``'s options this server takes (``-u``, which torchrun's agent passes its workers),
    and the rest: ``-m MODULE ARGS``, ``-c CODE ARGS`` or ``SCRIPT ARGS``."""
    unbuffered = False
    while argv and argv[0] == "-u":
        unbuffered, argv = True, argv[1:]
    return unbuffered, argv


def _std_streams(unbuffered: bool) -> None:
    """New ``sys.std*`` objects on fds 0-2, buffered as a new interpreter would buffer them (``-u``:
    stdout and stderr written through)."""
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
            errors="backslashreplace" if fd == 2 else None,
            line_buffering=fd == 2 or os.isatty(fd),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(code)`` ends a real interpreter with (a message goes to stderr, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: become the requested process, run it, exit as Python would."""
    os.setsid()
    for fd, received in enumerate(fds):
        os.dup2(received, fd)
        os.close(received)
    unbuffered, argv = _options(request["argv"])
    _std_streams(unbuffered)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    kind = argv[0] if argv[0] in ("-m", "-c") else "script"
    first = (
        {"-m": os.getcwd(), "-c": ""}[kind] if kind != "script" else os.path.dirname(os.path.abspath(argv[0]))
    )
    sys.path[:] = [first, *_pythonpath(os.environ.get("PYTHONPATH", "")), *_SITE]
    random.seed()
    sys.modules["numpy"].random.seed()
    code = 0
    try:
        if kind == "-m":
            sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file in argv[0]
            # A preloaded module (torch.distributed.run) runs afresh as __main__, as in a new
            # interpreter, without runpy's "found in sys.modules" warning.
            sys.modules.pop(argv[1], None)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif kind == "-c":
            sys.argv = ["-c", *argv[2:]]
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # an uncaught exception: traceback on stderr, status 1, as the interpreter does
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # the interpreter joins non-daemon threads before the atexit handlers
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _pythonpath(value: str) -> list[str]:
    return [os.path.abspath(entry) for entry in value.split(os.pathsep) if entry]


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: an 8-byte length, the JSON, and the client's fds 0-2 with the first bytes."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    (length,) = struct.unpack("!Q", data[:8])
    data = data[8:]
    while len(data) < length:
        chunk = conn.recv(length - len(data))
        if not chunk:
            raise ConnectionError("client left mid-request")
        data += chunk
    return json.loads(data), fds


_SITE: list[str] = []
"""The server's ``sys.path`` after its first entry and its ``PYTHONPATH``: the interpreter's own."""


def serve(path: str) -> None:
    own = _pythonpath(os.environ.get("PYTHONPATH", ""))
    _SITE[:] = [entry for entry in sys.path[1:] if entry not in own]
    for module in PRELOAD:
        __import__(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients connect only to a listening server
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    while True:
        conns = {conn: pid for pid, conn in children.items()}
        ready, _, _ = select.select([listener, sys.stdin, *conns], [], [], 0.05)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return  # the test process that started us has ended
        for conn in ready:
            if conn in conns and not _alive(conn):  # the client is gone: so is its process
                with contextlib.suppress(ProcessLookupError):
                    os.kill(conns[conn], signal.SIGKILL)
        if listener in ready:
            try:
                _accept(listener, [*conns], children)
            except Exception:  # one client's failure (it died mid-request, ...) never ends the server
                traceback.print_exc()
        _reap(children)


def _alive(conn: socket.socket) -> bool:
    try:
        return bool(conn.recv(1))
    except OSError:
        return False


def _accept(listener: socket.socket, others: list[socket.socket], children: dict[int, socket.socket]) -> None:
    """Take one request: refuse it, or fork the process it asks for (``children``: pid -> its client)."""
    conn, _ = listener.accept()
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError):
        conn.close()
        return
    why = _refusal(request["argv"], request["env"])
    print(f"{'refused (' + why + ')' if why else 'fork'}: {' '.join(request['argv'])[:200]}", file=sys.stderr)
    if why is not None:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError), conn:
            conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        for other in others:
            other.close()
        _become(request, fds)
    for fd in fds:
        os.close(fd)
    children[pid] = conn  # reaped, and killed if its client goes, whether or not this reply arrives
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _reap(children: dict[int, socket.socket]) -> None:
    """Tell each ended child's client its status, as ``subprocess`` reports it."""
    while children:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        status = -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
