"""What a launch (and, through the zygote's ``python`` wrapper, each rank a launcher starts) runs under the zygote:
``zygote_client.py SCRIPT ARGS...`` or ``zygote_client.py -m MODULE ARGS...`` (see zygote.py).

Imports nothing heavy: hands argv, environment, working folder and stdio to the server's forked child, forwards
the signals torchrun sends, and exits as the child did (with its code, or by the signal that ended it).
"""

import json
import os
import signal
import socket
import sys


def main() -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ["VITSCALE_TEST_ZYGOTE_SOCKET"])
    env = {k: v for k, v in os.environ.items() if k != "VITSCALE_TEST_ZYGOTE_SOCKET"}
    message = json.dumps({"argv": sys.argv[1:], "env": env, "cwd": os.getcwd()}).encode() + b"\n"
    socket.send_fds(conn, [message], [0, 1, 2])
    reader = conn.makefile("rb")
    child = int(reader.readline())

    def forward(signum, frame):  # noqa: ARG001
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    line = reader.readline()
    if not line:  # the server died: no status to give
        sys.exit(1)
    status = int(line)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
