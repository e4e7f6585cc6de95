"""Access-control policy (``shmbuffer/daemon/security.py``): tcp endpoints, groups, CURVE keys."""

from __future__ import annotations

import grp
import os
import socket
import stat
from pathlib import Path

import pytest
import zmq
import zmq.auth

from shmbuffer import curve
from shmbuffer.cli import main
from shmbuffer.curve import (
    KeyFileError,
    client_curve_options,
    keygen,
    load_public_key,
    load_secret_cert,
)
from shmbuffer.daemon import security
from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.daemon.security import (
    InsecureEndpointError,
    check_daemon_access,
    check_tcp_endpoint,
    is_loopback,
    resolve_group,
    segment_access,
    tcp_host,
)


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# -- tcp policy -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("tcp://127.0.0.1:5555", "127.0.0.1"),
        ("tcp://*:5555", "*"),
        ("tcp://[::1]:5555", "::1"),
        ("tcp://localhost:*", "localhost"),
        ("tcp://10.0.0.1:0", "10.0.0.1"),
        ("tcp://127.0.0.1:0;10.0.0.1:5555", "10.0.0.1"),
        ("ipc:///tmp/x.sock", None),
        ("inproc://x", None),
    ],
)
def test_tcp_host(endpoint, host):
    assert tcp_host(endpoint) == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "localhost", "LOCALHOST"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "::", "10.0.0.1", "eth0", "example.org"])
def test_non_loopback_hosts(host):
    assert not is_loopback(host)


@pytest.mark.parametrize("endpoint", ["ipc:///tmp/x.sock", "inproc://x"])
def test_ipc_needs_nothing(endpoint):
    assert check_tcp_endpoint(endpoint, curve=False, insecure=False) == []


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://localhost:*"])
def test_loopback_without_keys_warns(endpoint):
    warnings = check_tcp_endpoint(endpoint, curve=False, insecure=False)
    assert len(warnings) == 1
    assert "any local user can connect" in warnings[0]


@pytest.mark.parametrize(
    "endpoint", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.1:*", "tcp://eth0:1"]
)
def test_exposed_tcp_without_keys_is_refused(endpoint):
    with pytest.raises(InsecureEndpointError, match=r"refusing to bind .* without authentication"):
        check_tcp_endpoint(endpoint, curve=False, insecure=False)


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5555", "tcp://*:5555"])
def test_exposed_tcp_insecure_is_a_loud_warning(endpoint):
    (warning,) = check_tcp_endpoint(endpoint, curve=False, insecure=True)
    assert warning.startswith("INSECURE")


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5555", "tcp://*:1", "tcp://127.0.0.1:1"])
def test_curve_tcp_is_fine(endpoint):
    assert check_tcp_endpoint(endpoint, curve=True, insecure=False) == []


def test_check_daemon_access(tmp_path):
    pub, sec = keygen(tmp_path, "server")
    assert check_daemon_access(DaemonConfig(endpoint="tcp://*:1", curve_secret=str(sec))) == []
    with pytest.raises(InsecureEndpointError):
        check_daemon_access(DaemonConfig(endpoint="tcp://*:1"))
    with pytest.raises(KeyFileError, match="no secret key"):
        check_daemon_access(DaemonConfig(endpoint="tcp://*:1", curve_secret=str(pub)))
    with pytest.raises(KeyFileError, match="needs --curve-secret"):
        check_daemon_access(DaemonConfig(curve_clients=str(tmp_path)))
    with pytest.raises(KeyFileError, match="not a folder"):
        check_daemon_access(
            DaemonConfig(curve_secret=str(sec), curve_clients=str(tmp_path / "nope"))
        )
    with pytest.raises(ValueError, match="unknown group"):
        check_daemon_access(DaemonConfig(group="no-such-group-shmbuffer"))


def test_config_toml_has_the_security_settings(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text(
        '[daemon]\ngroup = "0"\ncurve_secret = "/k/server.key_secret"\n'
        'curve_clients = "/k/clients"\ninsecure_tcp = true\n'
    )
    config = DaemonConfig.load(path, insecure_tcp=None)  # an absent CLI flag overrides nothing
    assert config.group == "0"
    assert config.curve_secret == "/k/server.key_secret"
    assert config.curve_clients == "/k/clients"
    assert config.insecure_tcp is True


# -- groups -----------------------------------------------------------------------------------


def test_resolve_group():
    gid = os.getgid()
    assert resolve_group(None) is None
    assert resolve_group(gid) == gid
    assert resolve_group(str(gid)) == gid
    assert resolve_group(grp.getgrgid(gid).gr_name) == gid
    with pytest.raises(ValueError, match="unknown group"):
        resolve_group("no-such-group-shmbuffer")


def test_segment_access_modes():
    assert segment_access(None) == {"file_mode": 0o600, "group": None}
    assert segment_access(os.getgid()) == {"file_mode": 0o660, "group": os.getgid()}


def test_ipc_socket_modes(tmp_path):
    path = tmp_path / "s.sock"
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(path))
        security.secure_ipc_path(path, None)
        assert mode(path) == 0o600
        security.secure_ipc_path(path, os.getgid())
        assert mode(path) == 0o660
        assert os.stat(path).st_gid == os.getgid()
    finally:
        sock.close()


def test_share_with_group_only_touches_private_folders_of_ours(tmp_path):
    private = tmp_path / "private"
    private.mkdir(0o700)
    os.chmod(private, 0o700)
    security.share_with_group(private, os.getgid(), 0o050)
    assert mode(private) == 0o750
    public = tmp_path / "public"
    public.mkdir()
    os.chmod(public, 0o1777)
    security.share_with_group(public, os.getgid(), 0o050)
    assert mode(public) == 0o1777  # /tmp-like folders are left alone
    security.share_with_group(private, None, 0o070)
    assert mode(private) == 0o750


# -- keys -------------------------------------------------------------------------------------


def test_keygen_files_and_modes(tmp_path):
    out = tmp_path / "keys"
    public, secret = keygen(out, "server")
    assert (public, secret) == (out / "server.key", out / "server.key_secret")
    assert mode(out) == 0o700
    assert mode(secret) == 0o600
    assert mode(public) == 0o644
    pub, sec = zmq.auth.load_certificate(secret)
    assert sec is not None and len(sec) == 40
    assert zmq.auth.load_certificate(public) == (pub, None)
    assert load_public_key(public) == pub
    assert load_secret_cert(secret) == (pub, sec)
    with pytest.raises(KeyFileError, match="exists"):
        keygen(out, "server")
    public2, _ = keygen(out, "server", force=True)
    assert load_public_key(public2) != pub
    with pytest.raises(KeyFileError, match="invalid key name"):
        keygen(out, "../x")


def test_keygen_cli(tmp_path, capsys):
    assert main(["keygen", "--out", str(tmp_path), "--name", "client"]) == 0
    assert "client.key_secret" in capsys.readouterr().out
    assert mode(tmp_path / "client.key_secret") == 0o600
    assert (tmp_path / "client.key").is_file()
    assert main(["keygen", "--out", str(tmp_path), "--name", "client"]) == 1
    assert "--force" in capsys.readouterr().err


def test_load_keys(tmp_path):
    public, _ = keygen(tmp_path, "server")
    z85 = load_public_key(public)
    assert load_public_key(z85.decode()) == z85
    assert load_public_key(z85) == z85
    with pytest.raises(KeyFileError):
        load_public_key(tmp_path / "missing.key")
    with pytest.raises(KeyFileError, match="no secret key"):
        load_secret_cert(public)
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a certificate\n")
    with pytest.raises(KeyFileError):
        load_public_key(garbage)


def test_client_curve_options(tmp_path, monkeypatch):
    monkeypatch.delenv(curve.ENV_CURVE_SERVER_KEY, raising=False)
    monkeypatch.delenv(curve.ENV_CURVE_CLIENT_CERT, raising=False)
    server_pub, _ = keygen(tmp_path, "server")
    _, client_sec = keygen(tmp_path, "client")
    assert client_curve_options() == {}
    with pytest.raises(KeyFileError, match="needs the server's public key"):
        client_curve_options(client_cert=client_sec)

    ephemeral = client_curve_options(server_pub)
    assert ephemeral[zmq.CURVE_SERVERKEY] == load_public_key(server_pub)
    assert len(ephemeral[zmq.CURVE_SECRETKEY]) == 40

    opts = client_curve_options(server_pub, client_sec)
    assert (opts[zmq.CURVE_PUBLICKEY], opts[zmq.CURVE_SECRETKEY]) == load_secret_cert(client_sec)

    monkeypatch.setenv(curve.ENV_CURVE_SERVER_KEY, str(server_pub))
    monkeypatch.setenv(curve.ENV_CURVE_CLIENT_CERT, str(client_sec))
    assert client_curve_options() == opts


# -- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".hidden", "/etc/passwd", "x" * 65])
def test_start_refuses_names_that_escape_the_storage_dir(name, tmp_path, capsys):
    rc = main(["start", "--name", name, "--storage-dir", str(tmp_path)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "invalid segment name" in err
    assert list(tmp_path.iterdir()) == []  # nothing was created
