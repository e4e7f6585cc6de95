"""Sending a message's frames over ZeroMQ, shared by the daemon and its clients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq


def send_frames(socket: zmq.Socket[Any], small: Sequence[bytes], payload: Sequence[Any]) -> None:
    """Send ``small`` frames (identity, msgpack header) by copy and ``payload`` frames (row
    bytes) zero-copy. Zero-copy sends of small frames cost far more in pyzmq (a tracked
    ``Frame`` per part) than copying a few hundred bytes."""
    last = len(small) - 1 if not payload else -1
    for i, frame in enumerate(small):
        socket.send(frame, zmq.SNDMORE if i != last else 0, copy=True)
    for i, frame in enumerate(payload):
        socket.send(frame, zmq.SNDMORE if i != len(payload) - 1 else 0, copy=False)
