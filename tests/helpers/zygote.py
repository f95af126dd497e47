"""Rank processes forked from one process that imported torch and Lightning once (a forkserver-style zygote).

Every rank of a ``torchrun`` launch used to start a fresh Python that imports torch, Lightning (with torchmetrics,
transformers, scipy, torchvision) and the package: ~8 s of CPU each on the 2-core CI machine, so a 2-rank launch
spent ~20 s on imports alone. Here ``torchrun`` itself is unchanged (torch's public elastic launcher: rendezvous,
environment, per-rank processes, failure handling, exit codes); only the program it starts for each rank is
:mod:`tests.helpers.zygote_client`, a tiny process that hands its argv, environment, working folder and stdio to
the server, which forks a child that runs the script as ``__main__`` exactly as ``python script.py`` would. The
client forwards torchrun's signals to that child and exits with its status (the same signal if it was killed), and
the child dies with the client, taking its own processes along (a timeout that SIGKILLs the launch's process tree
reaches them too). torch's elastic agent itself (``python -m torch.distributed.run``) is forked the same way, and
its ranks (``python -u script``) come back here through the wrapper below.

Launches through Lightning's own launcher (:func:`tests.helpers.launch.lightning_launch`, the examples' CLI runs)
come here too: the script's process is forked the same way, and its ``sys.executable`` is a small wrapper
(``python`` beside the socket) that runs the client, so the ranks Lightning's launcher starts with
``Popen([sys.executable, script, *argv])`` (or ``-m module``) are forked as well, with the environment the launcher
gave them. Launches that test something a fork cannot give (extra environment read at process start, such as
glibc's ``MALLOC_*``) start real processes: the helpers route only plain launches here.
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

# timm and HF's ViT: imported by most rank scripts' models, ~0.5 s each time a forked rank did it itself (a profile
# of the rank-launching tests: 13 s of CPU in all).
_PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "lightning", "lightning.pytorch",
            "lightning.pytorch.cli", "lightning_vitscale", "tests.helpers.models", "tests.helpers.scenarios", "timm",
            "transformers.models.vit.modeling_vit")
SOCKET_VARIABLE = "VITSCALE_TEST_ZYGOTE_SOCKET"
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


def wrapper_for(socket_path: str) -> str:
    """The ``python`` every child reports as ``sys.executable``: runs the client against this server."""
    return os.path.join(os.path.dirname(socket_path), "python")


def _write_wrapper(socket_path: str) -> None:
    client = Path(__file__).with_name("zygote_client.py")
    wrapper = wrapper_for(socket_path)
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\n{SOCKET_VARIABLE}="{socket_path}" exec "{sys.executable}" "{client}" "$@"\n')
    os.chmod(wrapper, 0o755)


def _reset_per_process_state(argv: list[str]) -> None:
    """What ``python script.py`` (or ``python -m module``) would have fresh that the server's imports computed."""
    sys.argv = argv
    sys.path[0] = os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
    from lightning.fabric.utilities import rank_zero as fabric_rank_zero
    from lightning_utilities.core import rank_zero as utils_rank_zero

    # Lightning reads the rank from the environment once, at import (in the server: no rank, so 0).
    fabric_rank_zero.rank_zero_only.rank = utils_rank_zero.rank_zero_only.rank = fabric_rank_zero._get_rank() or 0


def _die_with(conn: socket.socket) -> None:
    """Thread body: once the client is gone (a timeout's kill reaches only it), SIGKILL this child's own processes
    (the ranks an elastic agent started) and the child."""
    while conn.recv(1):
        pass
    from tests.helpers.launch import descendants

    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _run_main(argv: list[str]) -> None:
    """Run ``argv`` as ``python *argv`` would (a script, or ``-m module``), printing an uncaught exception as Python
    prints it, without the zygote's frames."""
    import runpy

    if argv[0] == "-u":  # how torch's elastic agent starts a rank; the ranks' environment is unbuffered already
        argv = argv[1:]
    _reset_per_process_state(argv)
    main_file = os.path.abspath(argv[0]) if argv[0] != "-m" else ""
    try:
        if main_file:
            runpy.run_path(main_file, run_name="__main__")
        else:  # as `python -m`: argv[0] becomes the module's file, __main__.__spec__ its spec
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001
        import traceback

        tb = error.__traceback__
        while tb is not None and main_file and tb.tb_frame.f_code.co_filename != main_file:
            tb = tb.tb_next
        traceback.print_exception(type(error), error, tb or error.__traceback__)
        sys.stderr.flush()
        raise SystemExit(1) from None
    raise SystemExit(0)


def _child(conn: socket.socket, message: dict, fds: list[int]) -> None:
    """In the forked child: become the rank process, run its script, never return into the server's loop."""
    import threading

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(message["env"])
    os.chdir(message["cwd"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=_die_with, args=(conn,), daemon=True).start()
    sys.executable = wrapper_for(message["socket"])  # its own Python subprocesses (ranks) come back here
    try:
        _run_main(message["argv"])
    except SystemExit as ended:
        _exit_without_teardown(ended.code)


def _exit_without_teardown(code: object) -> None:
    """End as ``python script.py`` ends, less the interpreter's teardown: what ``Py_FinalizeEx`` does that a caller
    can see (wait for non-daemon threads, such as a background checkpoint write; run ``atexit``; flush stdio), then
    ``os._exit``. The teardown deallocates every module object inherited from the server, which writes to (and so
    copies) every page of them: 150,000 page faults and ~1.5-3 s of CPU per launch (tests/distributed/test_dropin.py
    under ``perf stat``: 21-23 s of CPU before, 18-20 s after)."""
    import atexit
    import threading

    if code is not None and not isinstance(code, int):  # SystemExit("message"): printed, exit status 1
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's own exit calls first
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code or 0)


def serve(path: str) -> None:
    """Import once, then fork one child per client; report each child's pid, and its wait status when it ends."""
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    _warm()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    _write_wrapper(path)
    print("ready", flush=True)
    clients: dict[int, socket.socket] = {}
    parent = os.getppid()
    while os.getppid() == parent:  # the test process that started it is gone (killed): so is it
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            _fork_for(listener, clients)
        _report_ended(clients)


def _warm() -> None:
    """Lazy one-time work torch does in every rank that measures a step, done once here and inherited by each fork.

    A ``ShapeEnv``'s first symbol (the planner measures ``training_step``'s ``.item()`` as one) imports
    ``torch.export`` and the compiler's modules to list the files its stack summaries skip: ~0.4 s per process.
    ``gc.freeze()`` then moves everything imported so far out of the collector's view, so each fork's collections
    (the peak-memory helpers call ``gc.collect()`` per step) no longer walk torch's and Lightning's module objects.
    """
    import gc

    from torch.fx.experimental.symbolic_shapes import uninteresting_files

    uninteresting_files()
    gc.freeze()


def _fork_for(listener: socket.socket, clients: dict[int, socket.socket]) -> None:
    """Accept one client and fork its rank process (the child never returns from here)."""
    conn, _ = listener.accept()
    raw, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not raw.endswith(b"\n"):  # a stream: a long environment may come in several pieces
        raw += conn.recv(1 << 16)
    message = json.loads(raw) | {"socket": listener.getsockname()}
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
