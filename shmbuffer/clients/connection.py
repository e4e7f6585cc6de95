"""A client's line to the daemon: one DEALER socket, requests matched to replies by ``seq``.

Requests may be pipelined: :meth:`Connection.send` returns at once and :meth:`Connection.wait`
collects that request's reply later (the writer sends a commit and goes on copying). Every wait
is bounded; a daemon that does not answer in time raises :class:`DaemonUnavailableError`
instead of hanging the caller.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import zmq

from shmbuffer.daemon.runtime import resolve_endpoint
from shmbuffer.errors import DaemonUnavailableError, ProtocolError, error_from_code
from shmbuffer.protocol import check_version, decode, encode, request

Reply = tuple[dict[str, Any], list[zmq.Frame]]


class Connection:
    def __init__(
        self, target: str, role: str, *, timeout: float = 10.0, remote: bool = False
    ) -> None:
        self.endpoint = resolve_endpoint(target)
        self.timeout = timeout
        self._context = zmq.Context()  # per connection: safe across fork/spawn
        self.socket = self._context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)  # nothing rides on an unacknowledged message
        self.socket.connect(self.endpoint)
        self._seq = 0
        self._early: dict[int, Reply] = {}  # replies that arrived before anyone waited
        self._closed = False
        hello = self.call(
            "hello", role=role, pid=os.getpid(), host=socket.gethostname(), remote=remote
        )
        self.client_id: int = hello["client"]
        self.buffer: dict[str, Any] = hello["buffer"]
        self.daemon_pid: int = hello["daemon_pid"]

    def send(self, op: str, frames: Sequence[Any] = (), **fields: Any) -> int:
        self._seq += 1
        header = encode(request(op, self._seq, **fields))
        self.socket.send_multipart([header, *frames], copy=False)
        return self._seq

    def wait(self, seq: int, timeout: float | None = None) -> Reply:
        """The reply to request ``seq``; raises the daemon's error as its exception class."""
        self.wait_all([seq], timeout)
        header, payload = self._early.pop(seq)
        check_version(header.get("v"))
        if not header.get("ok"):
            error = header.get("error") or {}
            raise error_from_code(str(error.get("code")), str(error.get("message")))
        return header, payload

    def ready(self, seq: int) -> bool:
        """Whether the reply to ``seq`` can be taken without waiting."""
        while seq not in self._early and self.socket.poll(0):
            self._receive_one()
        return seq in self._early

    def wait_all(self, seqs: Sequence[int], timeout: float | None = None) -> None:
        """Wait (one deadline for all) until every reply in ``seqs`` has arrived."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for seq in seqs:
            while seq not in self._early:
                left = deadline - time.monotonic()
                if left <= 0 or not self.socket.poll(int(left * 1000) + 1):
                    waited = self.timeout if timeout is None else timeout
                    raise DaemonUnavailableError(
                        f"no reply from the daemon at {self.endpoint} within {waited:.1f}s "
                        f"(is it running? `shmbuffer-daemon status`)"
                    )
                self._receive_one()

    def _receive_one(self) -> None:
        frames = self.socket.recv_multipart(copy=False)
        header = decode(frames[0].buffer)
        got = header.get("seq")
        if not isinstance(got, int):
            raise ProtocolError(f"reply without a seq: {header!r}")
        self._early[got] = (header, frames[1:])

    def call(
        self, op: str, frames: Sequence[Any] = (), timeout: float | None = None, **fields: Any
    ) -> dict[str, Any]:
        return self.wait(self.send(op, frames, **fields), timeout)[0]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # the daemon may be gone; closing still succeeds
            self.call("bye", timeout=min(self.timeout, 2.0))
        self.socket.close()
        self._context.term()
