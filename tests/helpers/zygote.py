"""Rank processes forked from one process that imported torch and Lightning once (a forkserver-style zygote).

Every rank of a ``torchrun`` launch used to start a fresh Python that imports torch, Lightning (with torchmetrics,
transformers, scipy, torchvision) and the package: ~8 s of CPU each on the 2-core CI machine, so a 2-rank launch
spent ~20 s on imports alone. Here ``torchrun`` itself is unchanged (torch's public elastic launcher: rendezvous,
environment, per-rank processes, failure handling, exit codes); only the program it starts for each rank is
:mod:`tests.helpers.zygote_client`, a tiny process that hands its argv, environment, working folder and stdio to
the server, which forks a child that runs the script as ``__main__`` exactly as ``python script.py`` would. The
client forwards torchrun's signals to that child and exits with its status (the same signal if it was killed), and
the child dies with the client (a timeout that SIGKILLs the launch's process tree reaches it too).

Launches that test something a fork cannot give (extra environment read at process start, such as glibc's
``MALLOC_*``) start real processes: :func:`tests.helpers.launch.torchrun` routes only plain launches here.
``VITSCALE_TEST_ZYGOTE=0`` turns it off for a whole run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

_PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "lightning", "lightning.pytorch",
            "lightning_vitscale", "tests.helpers.models", "tests.helpers.scenarios")
_server: tuple[subprocess.Popen, str] | None = None


def enabled() -> bool:
    return os.environ.get("VITSCALE_TEST_ZYGOTE", "1") != "0"


def server_socket(env: dict[str, str], cwd: Path) -> str | None:
    """The socket of this test process's zygote, started on first use with ``env`` (the ranks' base environment);
    ``None`` if it could not start (the caller then starts real processes)."""
    global _server
    if _server is not None and _server[0].poll() is None:
        return _server[1]
    path = os.path.join(tempfile.mkdtemp(prefix="vitscale-zygote-"), "sock")
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.zygote", path], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], 180)
    if not ready or proc.stdout.readline().strip() != b"ready":  # type: ignore[union-attr]
        _stop(proc)
        return None
    _server = (proc, path)
    atexit.register(_stop, proc)
    return path


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _reset_per_process_state(argv: list[str]) -> None:
    """What ``python script.py`` would have fresh that the server's imports already computed."""
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    from lightning.fabric.utilities import rank_zero as fabric_rank_zero
    from lightning_utilities.core import rank_zero as utils_rank_zero

    # Lightning reads the rank from the environment once, at import (in the server: no rank, so 0).
    fabric_rank_zero.rank_zero_only.rank = utils_rank_zero.rank_zero_only.rank = fabric_rank_zero._get_rank() or 0


def _child(conn: socket.socket, message: dict, fds: list[int]) -> None:
    """In the forked child: become the rank process, run its script, never return into the server's loop."""
    import runpy
    import threading

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(message["env"])
    os.chdir(message["cwd"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def die_with_the_client() -> None:
        while conn.recv(1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_with_the_client, daemon=True).start()
    _reset_per_process_state(message["argv"])
    try:
        runpy.run_path(os.path.abspath(message["argv"][0]), run_name="__main__")
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - printed as Python prints it, without the zygote's frames
        import traceback

        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != os.path.abspath(message["argv"][0]):
            tb = tb.tb_next
        traceback.print_exception(type(error), error, tb or error.__traceback__)
        sys.stderr.flush()
        raise SystemExit(1) from None
    raise SystemExit(0)


def serve(path: str) -> None:
    """Import once, then fork one child per client; report each child's pid, and its wait status when it ends."""
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    clients: dict[int, socket.socket] = {}
    parent = os.getppid()
    while os.getppid() == parent:  # the test process that started it is gone (killed): so is it
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            _fork_for(listener, clients)
        _report_ended(clients)


def _fork_for(listener: socket.socket, clients: dict[int, socket.socket]) -> None:
    """Accept one client and fork its rank process (the child never returns from here)."""
    conn, _ = listener.accept()
    raw, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not raw.endswith(b"\n"):  # a stream: a long environment may come in several pieces
        raw += conn.recv(1 << 16)
    message = json.loads(raw)
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in clients.values():
            other.close()
        _child(conn, message, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    clients[pid] = conn


def _report_ended(clients: dict[int, socket.socket]) -> None:
    """Send each ended child's wait status to its client."""
    while clients:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):  # the client is gone already
                conn.sendall(f"{status}\n".encode())
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
