"""``cuvil`` commands run by forks of one process that has imported the command line already.

The docs walk (``tests/test_newcomer.py``) runs every ``sh`` block of README.md and docs/*.md as written: some
60 ``cuvil ...`` commands in the gate. A fresh ``python -m cuvil`` spends 1.6-2.5 s of CPU importing before it
does anything (onnx and ml_dtypes' ufunc loops ~1.1-1.4 s of it, the compiler's modules the rest), the same
import every time. Here a server imports ``cuvil.cli`` once; each command is a fork of it that takes the
command's arguments, working directory, environment and standard streams (passed as file descriptors), runs
``python -m cuvil`` would (the package's ``__main__``), and exits with its status; the client (the ``cuvil`` on the
walk's PATH) exits with the same status, or dies of the same signal, and forwards SIGINT/SIGTERM/SIGHUP.

What a fork cannot reproduce, the client leaves to a fresh ``python -m cuvil`` (:func:`client_script`): an
environment whose ``PYTHON*`` variables (``PYTHONHASHSEED``: a reproducibility check builds under another hash
seed), thread-count or loader variables differ from the server's, read by the interpreter or by numpy and
OpenBLAS at start-up; a server that is not there. A fresh process's own start (the entry point, the imports)
is tested by the tests that run ``python -m cuvil`` (tests/test_cli.py and others), not here.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Dict, Optional

#: Environment variables read when an interpreter (or numpy, OpenBLAS, the loader) starts: a command whose value
#: differs from the server's runs in a fresh process instead.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "OPENBLAS_", "MKL_", "LD_", "MALLOC_")


def startup_env(env) -> Dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return buf


# --- the server ----------------------------------------------------------------------------------------------

def serve(path: str) -> None:
    """Import the command line, then answer each connection on the Unix socket ``path`` with a fork.

    The command line is a layer above this one (setup.cfg's contracts): it is named, not imported, as a test
    that runs ``python -m cuvil`` in a subprocess names it: imported here by name to warm the forks, run in each
    by :func:`runpy.run_module`, as the interpreter's ``-m`` runs it."""
    importlib.import_module("cuvil.cli")         # what every `python -m cuvil` imports before it does anything
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path + ".tmp")
    os.rename(path + ".tmp", path)          # the client sees the socket only once it accepts connections
    sock.listen(64)
    # Stopped by SIGTERM: first wait for the commands still running. Each handler is waited for (here, or when
    # the next connection comes), and waits for its runner, so that their CPU time counts in this process's
    # children, and in whoever waits for this process (a profile of the test's CPU).
    signal.signal(signal.SIGTERM, lambda n, f: sys.exit(0))
    try:
        while True:
            conn, _ = sock.accept()
            if os.fork() == 0:
                sock.close()
                try:
                    _handle(conn)
                finally:
                    os._exit(0)
            conn.close()
            _reap(os.WNOHANG)
    finally:
        _reap(0)


def _reap(flags: int) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, flags)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _handle(conn: socket.socket) -> None:
    """One command: fork the runner, tell the client its pid, wait for it, send its exit code."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    (size,) = struct.unpack("!I", head + _recv_exact(conn, 4 - len(head)))
    request = json.loads(_recv_exact(conn, size))
    print("served: cuvil", *request["argv"], file=sys.stderr, flush=True)      # the server's log
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(struct.pack("!i", pid))
    _, status = os.waitpid(pid, 0)
    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))


def _run(request: dict, fds) -> None:
    """In the runner: become the command's process, run ``cuvil`` as ``python -m cuvil`` does, exit with its status."""
    import atexit
    import traceback
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    sys.argv = [request["argv0"], *request["argv"]]
    try:
        runpy.run_module("cuvil", run_name="__main__", alter_sys=True)      # cuvil/__main__.py: sys.exit(main())
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:               # noqa: BLE001 - what the interpreter would print for an uncaught one
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:               # noqa: BLE001 - a reader that went away: exit with the command's status
        pass
    os._exit(code & 0xFF)


# --- starting and stopping it --------------------------------------------------------------------------------

class WarmCli:
    """A server for commands run with ``env`` (its environment; the client compares start-up variables with it)."""

    def __init__(self, env: Dict[str, str], timeout: float = 120.0):
        self.folder = tempfile.mkdtemp(prefix="cuvil-warm-")
        self.path = os.path.join(self.folder, "cli.sock")      # short: a Unix socket path has ~107 bytes
        self.env = dict(env)
        self.log = open(os.path.join(self.folder, "server.log"), "w+")
        self.proc = subprocess.Popen([sys.executable, "-c", f"from cuvil.testing.warm_cli import serve; serve({self.path!r})"],
                                     env=self.env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"the warm cuvil server did not start:\n{self.log.read()[-2000:]}")
            time.sleep(0.05)

    def write_client(self, folder: str, python: str) -> str:
        """Write the ``cuvil`` executable into ``folder``: it asks this server, or runs ``python -m cuvil`` where a
        fork would differ (the start-up environment) or the server is gone. Returns its path."""
        client = os.path.join(folder, "cuvil-client.py")
        with open(client, "w", encoding="utf-8") as f:
            f.write(f"PATH, PYTHON, PREFIXES = {self.path!r}, {python!r}, {STARTUP_PREFIXES!r}\n"
                    f"ENV = {startup_env(self.env)!r}\n" + CLIENT)
        shim = os.path.join(folder, "cuvil")
        with open(shim, "w", encoding="utf-8") as f:
            f.write(f'#!/bin/sh\nexec "{python}" -S -E "{client}" "$@"\n')
        os.chmod(shim, 0o755)
        return shim

    def served(self) -> str:
        """The server's log: a line ``served: cuvil ARGS`` per command it ran."""
        with open(os.path.join(self.folder, "server.log"), encoding="utf-8") as f:
            return f.read()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)


#: The client's code after its constants (PATH, PYTHON, PREFIXES, ENV), run as ``python -S -E`` (no site-packages,
#: no PYTHON* variables: ~20 ms): the command's process until the runner's exit code comes back.
CLIENT = r"""
import os, signal, socket, struct, sys
argv = sys.argv[1:]


def fresh():
    os.execv(PYTHON, [PYTHON, "-m", "cuvil", *argv])


if {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)} != ENV:
    fresh()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    import json
    s.connect(PATH)
    data = json.dumps({"argv": argv, "argv0": "-m", "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(s, [struct.pack("!I", len(data))], [0, 1, 2])
    s.sendall(data)
except OSError:
    s.close()
    fresh()


def read4():
    buf = b""
    while len(buf) < 4:
        chunk = s.recv(4 - len(buf))
        if not chunk:
            sys.stderr.write("cuvil: the warm server went away\n")
            os._exit(70)
        buf += chunk
    return struct.unpack("!i", buf)[0]


pid = read4()
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda n, f: os.kill(pid, n))
code = read4()
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
"""
