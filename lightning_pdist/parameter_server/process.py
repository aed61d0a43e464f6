"""Parameter-server processes: fork one (:func:`start_server`) or run one in the foreground (:func:`main`).

A forked server closes every descriptor it inherited except its listener and its lifeline (a dead parent's peers
must see EOF), ignores ``SIGINT`` (Ctrl-C reaches the whole process group; the workers' teardown or the lifeline
ends the server in order) and names itself ``pdist-ps<index>``. It exits when the worker that started it (a node's
local rank 0) sends ``SHUTDOWN``; when no connection is left and at least one worker had said ``HELLO``; when its
lifeline pipe reaches EOF (the process that started it died, however); or after ``idle_timeout`` seconds without
any connection and no worker yet.

By hand: ``python -m lightning_pdist.parameter_server.process --index I --host ADDR --port P ...`` (:func:`main`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from lightning_pdist.core.forking import fork_process
from lightning_pdist.core.ps_auth import check_secret, read_secret_file
from lightning_pdist.parameter_server.server import ServerLimits, ShardServer
from lightning_pdist.core.ps_wire import parse_networks

__all__ = ["ServerProcess", "main", "start_server"]


@dataclass
class ServerProcess:
    """A forked server process, seen from the process that started it."""

    index: int
    pid: int
    host: str
    port: int
    lifeline: int  # write end of the pipe whose EOF tells the server its parent is gone

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def poll(self) -> int | None:
        """The exit status if the process has exited (and reap it), else ``None``."""
        if self.pid <= 0:
            return 0
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid == 0:
            return None
        self.pid = -self.pid
        return os.waitstatus_to_exitcode(status)

    def join(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None or time.monotonic() >= deadline:
                return code
            time.sleep(0.02)

    def close_lifeline(self) -> None:
        if self.lifeline >= 0:
            os.close(self.lifeline)
            self.lifeline = -1

    def stop(self, timeout: float = 10.0) -> int:
        """Close the lifeline, wait up to ``timeout`` s, then SIGKILL; always reaps the process."""
        self.close_lifeline()
        code = self.join(timeout)
        if code is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = self.join(timeout)
        return code if code is not None else -signal.SIGKILL


def _set_process_name(name: str) -> None:
    try:  # /proc/<pid>/comm shows it; tests look for leftover "pdist-ps*" processes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def _close_inherited_fds(keep: set[int]) -> None:
    # A forked server must not hold copies of its parent's sockets (gloo, the TCP store, the launcher's
    # pipes): while it did, a dead parent's peers would never see EOF.
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def start_server(
    index: int,
    host: str = "127.0.0.1",
    port: int = 0,
    allowed_networks: str = "127.0.0.0/8",
    idle_timeout: float = 300.0,
    io_timeout: float = 300.0,
    limits: ServerLimits | None = None,
    secret: bytes | None = None,
) -> ServerProcess:
    """Fork a server process bound to ``host:port`` (``port=0``: any free port) and return its handle.

    ``limits`` bound what one peer may cost the server (default: every deadline ``io_timeout``). ``secret``
    (at least 32 bytes, handed over in memory): every connection must prove it holds it before its first request;
    ``None``: no authentication.

    The socket is bound here, before the fork, so a bad address fails in the caller and the port is
    known (and accepting) before this returns. Call it before creating other sockets if possible; the
    child closes every inherited descriptor except its own anyway.
    """
    parse_networks(allowed_networks)  # fail here, not in the child
    secret = check_secret(secret, f"start_server(index={index})")
    limits = limits if limits is not None else ServerLimits.from_io_timeout(io_timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=128)
    bound_host, bound_port = listener.getsockname()[:2]
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = fork_process()  # garbage gloo groups collected here; the child never collects what it inherits
    if pid == 0:  # child
        code = 1
        try:
            os.close(write_end)
            _close_inherited_fds({listener.fileno(), read_end})
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _set_process_name(f"pdist-ps{index}")
            torch.set_num_threads(1)
            ShardServer(index, listener, read_end, allowed_networks, idle_timeout, limits=limits, secret=secret).serve()
            code = 0
        except BaseException:  # noqa: BLE001  (report anything, then leave without running the parent's atexit)
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(read_end)
    listener.close()
    return ServerProcess(index=index, pid=pid, host=bound_host, port=bound_port, lifeline=write_end)


def main(argv: list[str] | None = None) -> None:
    """Run one server in the foreground (multi-node: start one per server host, pass their addresses).

    ``python -m lightning_pdist.parameter_server.process --index 0 --host 0.0.0.0 --port 29600 --allowed-networks 10.1.0.0/16
    --secret-file ~/.pdist/secret`` (the same file, mode 600, as the strategy's ``server_secret_file``). Without
    ``--secret-file`` the server refuses to start unless ``--insecure`` is given.
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--allowed-networks", default="127.0.0.0/8")
    parser.add_argument("--idle-timeout", type=float, default=300.0)
    parser.add_argument("--secret-file", default=None, help="file holding the shared secret (mode 600, >= 32 bytes); "
                        "required unless --insecure")  # fmt: skip
    parser.add_argument("--insecure", action="store_true", help="run without --secret-file: unauthenticated, any process "
                        "that can reach the port from --allowed-networks may push, read parameters or shut the server down")  # fmt: skip
    defaults = ServerLimits()
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections)
    parser.add_argument("--message-timeout", type=float, default=defaults.message_timeout)
    parser.add_argument("--reply-timeout", type=float, default=defaults.reply_timeout)
    parser.add_argument("--handshake-timeout", type=float, default=defaults.handshake_timeout)
    parser.add_argument("--max-init-bytes", type=int, default=defaults.max_init_bytes)
    args = parser.parse_args(argv)
    parse_networks(args.allowed_networks)
    if args.secret_file is None and not args.insecure:
        parser.error("--secret-file is required: without it any process that can reach the port may push gradients, "
                     "read parameters or shut the server down (give --insecure to run unauthenticated anyway)")  # fmt: skip
    if args.secret_file is not None and args.insecure:
        parser.error(f"--insecure with --secret-file {args.secret_file!r}: give one of them")
    secret = None
    if args.secret_file is not None:
        try:
            secret = read_secret_file(args.secret_file)
        except ValueError as err:
            parser.error(f"--secret-file {err}")
    limits = ServerLimits(args.max_connections, args.message_timeout, args.reply_timeout, args.handshake_timeout,
                          args.max_init_bytes)  # fmt: skip
    listener = socket.create_server((args.host, args.port), backlog=128)
    print(f"pdist parameter server {args.index} listening on {listener.getsockname()[0]}:{listener.getsockname()[1]}", flush=True)
    torch.set_num_threads(1)
    server = ShardServer(args.index, listener, None, args.allowed_networks, args.idle_timeout, limits=limits, secret=secret)
    if secret is None:
        server.loop.log(f"WARNING: unauthenticated (--insecure): any process that can reach this port from "
                    f"{args.allowed_networks}, of any user, can push gradients, read parameters or shut the server down")  # fmt: skip
    server.serve()


if __name__ == "__main__":
    main()
