"""Which process is at the other end of a unix socket, and whether it still runs: a pid the
kernel vouches for, told apart from a later process that reuses it by its start time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from shmbuffer.daemon.processes import Process, alive, peer_process, process_of, start_time


def test_the_peer_of_a_unix_socket_is_the_process_at_its_other_end() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        assert peer_process(left) == process_of(os.getpid())
    assert alive(Process(os.getpid(), start_time(os.getpid()) or 0))


def test_a_process_that_exited_or_a_reused_pid_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    assert process_of(child.pid) is None or process_of(child.pid) != Process(child.pid, 0)
    me = process_of(os.getpid())
    assert me is not None
    assert not alive(me._replace(start=me.start + 1))  # same pid, another start: not it
    assert process_of(0) is None and process_of(-5) is None


def test_a_command_name_with_spaces_and_parentheses_is_parsed() -> None:
    script = (
        "import sys; open('/proc/self/comm', 'w').write('a (b) c'); "
        "print('ready', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        executable=sys.executable,
    )
    try:
        assert child.stdout is not None and child.stdout.readline()
        with open(f"/proc/{child.pid}/stat") as f:
            assert "(a (b) c)" in f.read()
        assert start_time(child.pid) is not None
        assert alive(Process(child.pid, start_time(child.pid) or -1))
    finally:
        child.kill()
        child.wait(10)
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        child.stdout.close()
