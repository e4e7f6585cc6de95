"""Access control against a real daemon: owner-only files and socket (probed as ``nobody``),
``--group``, CURVE on tcp, and the tcp-without-keys policy."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from shmbuffer import Reader, Writer
from shmbuffer.cli.demo_loops import make_episode
from shmbuffer.clients.connection import Connection
from shmbuffer.errors import DaemonUnavailableError
from shmbuffer.wire.curve import ENV_CURVE_CLIENT_CERT, ENV_CURVE_SERVER_KEY, keygen
from shmbuffer.wire.protocol import decode, encode, request
from tests.e2e.conftest import START_TIMEOUT_S, wait_for

REFUSE_S = 2.0  # how long a refused client waits for a reply that never comes


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def ipc_path(endpoint: str) -> Path:
    assert endpoint.startswith("ipc://"), endpoint
    return Path(endpoint[len("ipc://") :])


def write_one(target: str, **keys: Any) -> None:
    """One episode, so that the (lazy) segment exists."""
    with Writer(target, **keys) as w:
        w.add_episode(make_episode(0, 0, 10, (2,)))


# -- probing as another user ------------------------------------------------------------------

PROBE = textwrap.dedent(
    """
    import json, socket, sys
    data, sock_path, endpoint = sys.argv[1:4]
    out = {}
    try:
        open(data, "r+b").close()
        out["open"] = "ok"
    except OSError as exc:
        out["open"] = type(exc).__name__
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect(sock_path)
        out["connect"] = "ok"
    except OSError as exc:
        out["connect"] = type(exc).__name__
    finally:
        s.close()
    try:  # the whole client path too, where this interpreter has pyzmq
        import zmq
        import msgpack
    except ImportError:
        out["ping"] = "skipped"
    else:
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(endpoint)
        hdr = {"v": sys.argv[4], "op": "ping", "seq": 1}
        d.send(msgpack.packb(hdr, use_bin_type=True))
        out["ping"] = "reply" if d.poll(2000) else "no reply"
        d.close()
        ctx.term()
    print(json.dumps(out))
    """
)


def _probe_python() -> str | None:
    """An interpreter the ``nobody`` user can run (ours may live in a private home)."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not candidate:
            continue
        try:
            ok = subprocess.run(
                [candidate, "-c", "pass"],
                check=False,
                user="nobody",
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if ok.returncode == 0:
            return candidate
    return None


@pytest.fixture
def as_nobody() -> Any:
    """``probe(data_file, endpoint, group=None) -> dict``: run :data:`PROBE` as ``nobody``."""
    if os.geteuid() != 0:
        pytest.skip("probing as another user needs root (to switch to `nobody`)")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no `nobody` user")
    python = _probe_python()
    if python is None:
        pytest.skip("no Python interpreter that `nobody` may execute")

    def probe(data: Path, endpoint: str, group: str | None = None) -> dict[str, str]:
        from shmbuffer.wire.protocol import PROTOCOL_VERSION

        argv = [python, "-c", PROBE, str(data), str(ipc_path(endpoint)), endpoint]
        done = subprocess.run(
            [*argv, PROTOCOL_VERSION],
            check=False,
            user="nobody",
            group=group,
            extra_groups=[] if group is None else [group],
            capture_output=True,
            text=True,
            timeout=30,
            cwd="/",
        )
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    return probe


def test_segment_and_socket_are_owner_only(daemon, as_nobody):
    d = daemon()
    write_one(d.name)
    data, manifest = d.segment_path / "data.bin", d.segment_path / "manifest.json"
    sock = ipc_path(d.endpoint)
    assert mode(data) == 0o600
    assert mode(manifest) == 0o600
    assert mode(d.segment_path) == 0o700
    assert mode(sock) == 0o600
    assert mode(d.env.runtime_file(d.name)) == 0o600

    seen = as_nobody(data, d.endpoint)
    assert seen["open"] == "PermissionError", seen
    assert seen["connect"] == "PermissionError", seen
    assert seen["ping"] in ("no reply", "skipped"), seen
    assert d.stats()["name"] == d.name  # the daemon is unharmed


def test_group_shares_segment_and_socket(daemon, e2e_env, as_nobody):
    """``--group nogroup`` opens everything to that group: ``nobody`` (a member) gets in."""
    group = "nogroup" if _has_group("nogroup") else "nobody"
    if not _has_group(group):
        pytest.skip("no `nogroup`/`nobody` group to share with")
    import grp

    gid = grp.getgrnam(group).gr_gid
    d = daemon(args=["--group", group])
    write_one(d.name)
    data = d.segment_path / "data.bin"
    assert mode(d.segment_path) == 0o750
    assert mode(data) == 0o660
    assert mode(ipc_path(d.endpoint)) == 0o660
    for path in (d.segment_path, data, ipc_path(d.endpoint)):
        assert os.stat(path).st_gid == gid, path
    assert mode(e2e_env.runtime_dir) == 0o750
    assert mode(e2e_env.runtime_file(d.name)) == 0o640

    seen = as_nobody(data, d.endpoint, group=group)
    assert seen["open"] == "ok", seen
    assert seen["connect"] == "ok", seen
    assert seen["ping"] in ("reply", "skipped"), seen


def _has_group(name: str) -> bool:
    import grp

    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def test_group_modes_with_own_group(daemon, e2e_env):
    gid = os.getgid()
    d = daemon(args=["--group", str(gid)])
    write_one(d.name)
    data, manifest = d.segment_path / "data.bin", d.segment_path / "manifest.json"
    assert (mode(d.segment_path), mode(data), mode(manifest)) == (0o750, 0o660, 0o660)
    assert mode(ipc_path(d.endpoint)) == 0o660
    assert os.stat(data).st_gid == gid
    assert mode(e2e_env.runtime_dir) == 0o750
    with Reader(d.name) as r:  # the owner still uses it as before
        assert r.sample(4).batch_size[0] == 4


# -- CURVE ------------------------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """server, an allowed client (its public key in ``clients/``) and a stranger."""
    out: dict[str, Path] = {}
    pub, out["server_secret"] = keygen(tmp_path / "server", "server")
    out["server_key"] = pub
    allowed = tmp_path / "clients"
    client_pub, out["client_cert"] = keygen(tmp_path / "client", "client")
    allowed.mkdir()
    shutil.copy(client_pub, allowed / "client.key")
    out["clients"] = allowed
    _, out["stranger_cert"] = keygen(tmp_path / "stranger", "stranger")
    _, out["other_secret"] = keygen(tmp_path / "other", "other")
    out["other_key"] = tmp_path / "other" / "other.key"
    return out


def plain_ping(endpoint: str, timeout: float = REFUSE_S) -> bool:
    """A plain DEALER (no CURVE) sends ``ping``: whether any reply came in ``timeout``."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send(encode(request("ping", 1)))
        if not dealer.poll(int(timeout * 1000)):
            return False
        decode(dealer.recv_multipart()[0])
        return True
    finally:
        dealer.close()
        ctx.term()


def refused(endpoint: str, **keys: Any) -> str:
    """Connect with ``keys``; the connection must fail within its timeout. Its message."""
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailableError) as info:
        Connection(endpoint, "admin", timeout=REFUSE_S, **keys)
    assert time.monotonic() - t0 < REFUSE_S + 2.0
    return str(info.value)


def curve_daemon(daemon: Any, keys: dict[str, Path], *extra: str) -> Any:
    return daemon(
        args=[
            "--endpoint",
            "tcp://127.0.0.1:*",
            "--curve-secret",
            str(keys["server_secret"]),
            *extra,
        ]
    )


def test_curve_server_key_required(daemon, keys, monkeypatch):
    monkeypatch.delenv(ENV_CURVE_SERVER_KEY, raising=False)
    monkeypatch.delenv(ENV_CURVE_CLIENT_CERT, raising=False)
    d = curve_daemon(daemon, keys)
    assert d.endpoint.startswith("tcp://127.0.0.1:")
    assert "without authentication" not in d.log()

    # with the server's key (and an ephemeral client key: no --curve-clients)
    conn = Connection(d.endpoint, "admin", timeout=5.0, curve_server_key=keys["server_key"])
    try:
        assert conn.call("ping") is not None
    finally:
        conn.close()

    # the Z85 text works as well as the file
    from shmbuffer.wire.curve import load_public_key

    z85 = load_public_key(keys["server_key"]).decode()
    conn = Connection(d.endpoint, "admin", timeout=5.0, curve_server_key=z85)
    conn.close()

    assert not plain_ping(d.endpoint), "a client without CURVE keys got a reply"
    message = refused(d.endpoint)
    assert "CURVE" in message, message
    message = refused(d.endpoint, curve_server_key=keys["other_key"])
    assert "CURVE" in message, message


def test_curve_clients_allow_list(daemon, keys, monkeypatch):
    monkeypatch.delenv(ENV_CURVE_SERVER_KEY, raising=False)
    monkeypatch.delenv(ENV_CURVE_CLIENT_CERT, raising=False)
    d = curve_daemon(daemon, keys, "--curve-clients", str(keys["clients"]))

    conn = Connection(
        d.endpoint,
        "admin",
        timeout=5.0,
        curve_server_key=keys["server_key"],
        curve_client_cert=keys["client_cert"],
    )
    try:
        assert conn.call("ping") is not None
    finally:
        conn.close()

    message = refused(
        d.endpoint, curve_server_key=keys["server_key"], curve_client_cert=keys["stranger_cert"]
    )
    assert "refused this client's CURVE key" in message, message
    message = refused(d.endpoint, curve_server_key=keys["server_key"])  # ephemeral key
    assert "refused this client's CURVE key" in message, message
    assert not plain_ping(d.endpoint)
    message = refused(
        d.endpoint, curve_server_key=keys["other_key"], curve_client_cert=keys["client_cert"]
    )
    assert "CURVE" in message, message

    # the daemon is still serving the allowed client afterwards
    conn = Connection(
        d.endpoint,
        "admin",
        timeout=5.0,
        curve_server_key=keys["server_key"],
        curve_client_cert=keys["client_cert"],
    )
    conn.close()


def test_curve_keys_from_environment(daemon, keys, monkeypatch):
    """Existing code (``Writer(name)``, ``Reader(name)``) works unchanged with the env vars."""
    d = curve_daemon(daemon, keys, "--curve-clients", str(keys["clients"]))
    monkeypatch.setenv(ENV_CURVE_SERVER_KEY, str(keys["server_key"]))
    monkeypatch.setenv(ENV_CURVE_CLIENT_CERT, str(keys["client_cert"]))
    write_one(d.name)  # found by name through the runtime file; local: rows in shared memory
    with Reader(d.name) as r:
        assert r.sample(4).batch_size[0] == 4
    monkeypatch.setenv(ENV_CURVE_CLIENT_CERT, str(keys["stranger_cert"]))
    with pytest.raises(DaemonUnavailableError):
        Writer(d.name, timeout=REFUSE_S)
    monkeypatch.delenv(ENV_CURVE_CLIENT_CERT)
    monkeypatch.delenv(ENV_CURVE_SERVER_KEY)
    with pytest.raises(DaemonUnavailableError, match="CURVE"):
        Reader(d.name, timeout=REFUSE_S)


def test_curve_keys_as_constructor_arguments(daemon, keys, monkeypatch):
    monkeypatch.delenv(ENV_CURVE_SERVER_KEY, raising=False)
    monkeypatch.delenv(ENV_CURVE_CLIENT_CERT, raising=False)
    d = curve_daemon(daemon, keys, "--curve-clients", str(keys["clients"]))
    opts = {"curve_server_key": keys["server_key"], "curve_client_cert": keys["client_cert"]}
    write_one(d.endpoint, remote=True, **opts)  # rows over the authenticated socket
    with Reader(d.endpoint, remote=True, **opts) as r:
        assert r.sample(4).batch_size[0] == 4


# -- tcp without keys -------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:0"])  # more forms: test_security.py
def test_exposed_tcp_without_keys_is_refused(e2e_env, endpoint):
    done = e2e_env.cli(
        "start",
        "--name",
        "exposed",
        "--endpoint",
        endpoint,
        "--storage-dir",
        str(e2e_env.storage_dir),
        timeout=START_TIMEOUT_S,
    )
    assert done.returncode == 1
    assert "refusing to bind" in done.stderr
    assert "--curve-secret" in done.stderr and "--insecure-tcp" in done.stderr
    assert e2e_env.read_runtime("exposed") is None


def test_insecure_tcp_is_allowed_with_a_loud_warning(daemon):
    d = daemon(args=["--endpoint", "tcp://0.0.0.0:*", "--insecure-tcp"])
    assert "INSECURE" in d.log()
    assert plain_ping(d.endpoint.replace("0.0.0.0", "127.0.0.1"), timeout=5.0)


def test_loopback_tcp_without_keys_warns(daemon):
    d = daemon(args=["--endpoint", "tcp://127.0.0.1:*"])
    wait_for(lambda: "any local user can connect" in d.log(), 5.0, what="the warning")
    assert plain_ping(d.endpoint, timeout=5.0)
