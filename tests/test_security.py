"""Access-control policy (``shmbuffer/daemon/security.py``): tcp endpoints, groups, CURVE keys."""

from __future__ import annotations

import grp
import os
import re
import socket
import stat
import tempfile
from pathlib import Path

import pytest
import zmq
import zmq.auth

from shmbuffer import runtime
from shmbuffer.cli import main
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
from shmbuffer.errors import ConfigError, PermissionDeniedError
from shmbuffer.wire import curve
from shmbuffer.wire.curve import (
    KeyFileError,
    client_curve_options,
    keygen,
    load_public_key,
    load_secret_cert,
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


# -- runtime folders and files others could write or plant are refused -------------------------


OTHER_UID = 65534  # `nobody`; chown needs root


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")


def test_runtime_dir_writable_by_others_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "rt"
    folder.mkdir()
    monkeypatch.setenv("SHMBUFFER_RUNTIME_DIR", str(folder))
    for bad in (0o777, 0o770, 0o1777):
        os.chmod(folder, bad)
        with pytest.raises(PermissionDeniedError, match="lets other users write") as info:
            runtime.runtime_dir()
        assert str(folder) in str(info.value)
    os.chmod(folder, 0o750)  # what --group makes of it: read, not write
    assert runtime.runtime_dir() == folder


def test_default_runtime_dir_of_another_user_is_refused(tmp_path, monkeypatch):
    needs_root()
    monkeypatch.delenv("SHMBUFFER_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / f"shmbuffer-{os.getuid()}"
    planted.mkdir(mode=0o755)
    os.chown(planted, OTHER_UID, -1)
    with pytest.raises(PermissionDeniedError, match=f"belongs to uid {OTHER_UID}"):
        runtime.runtime_dir()
    with pytest.raises(PermissionDeniedError):
        runtime.resolve_endpoint("default")
    # named explicitly (how --group members find a daemon), another user's folder is read
    monkeypatch.setenv("SHMBUFFER_RUNTIME_DIR", str(planted))
    assert runtime.runtime_dir() == planted


def test_untrusted_runtime_files_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMBUFFER_RUNTIME_DIR", str(tmp_path))
    os.chmod(tmp_path, 0o700)
    path = runtime.write("buf", {"endpoint": "ipc:///x", "pid": 1})
    assert mode(path) == 0o600
    assert runtime.read("buf")["endpoint"] == "ipc:///x"
    os.chmod(path, 0o622)
    with pytest.raises(PermissionDeniedError, match="refusing runtime file"):
        runtime.read("buf")
    os.chmod(path, 0o600)
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, -1)
        with pytest.raises(PermissionDeniedError, match=f"owned by uid {OTHER_UID}"):
            runtime.read("buf")
    path.unlink()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "real.json").write_text('{"endpoint": "tcp://10.0.0.1:1"}')
    path.symlink_to(tmp_path / "elsewhere" / "real.json")
    with pytest.raises(PermissionDeniedError, match="symlink"):
        runtime.read("buf")
    assert runtime.live_daemons() == []  # listing skips what it cannot trust


# -- admin requests over tcp need CURVE or --insecure-tcp-admin --------------------------------


@pytest.mark.parametrize(
    ("endpoint", "curve", "allow", "refused"),
    [
        ("ipc:///tmp/x.sock", False, False, False),
        ("tcp://127.0.0.1:5555", False, False, True),
        ("tcp://0.0.0.0:5555", False, False, True),
        ("tcp://127.0.0.1:5555", True, False, False),
        ("tcp://127.0.0.1:5555", False, True, False),
    ],
)
def test_admin_refusal(endpoint, curve, allow, refused):
    reason = security.admin_refusal(endpoint, curve, allow)
    assert (reason is not None) == refused
    if reason is not None:
        assert "--insecure-tcp-admin" in reason and endpoint in reason


def test_insecure_tcp_admin_is_a_loud_warning():
    config = DaemonConfig(endpoint="tcp://127.0.0.1:5555", insecure_tcp_admin=True)
    assert any(w.startswith("INSECURE: any client") for w in check_daemon_access(config))
    assert not any("INSECURE" in w for w in check_daemon_access(DaemonConfig()))


# -- settings: bad endpoints, TTLs and flags are refused up front ------------------------------


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("tcp://127.0.0.1:99999", "port '99999'"),
        ("tcp://127.0.0.1:-1", "port '-1'"),
        ("tcp://127.0.0.1:http", "port 'http'"),
        ("tcp://127.0.0.1", "expected tcp://HOST:PORT"),
        ("tcp://:5555", "expected tcp://HOST:PORT"),
        ("udp://127.0.0.1:5555", "transport 'udp'"),
        ("inproc://x", "transport 'inproc'"),
        ("/tmp/x.sock", "transport '/tmp/x.sock'"),
        ("ipc://", "the ipc path is empty"),
        ("ipc:///tmp/" + "y" * 103, "is 108 bytes, over the kernel's limit of 107"),
    ],
)
def test_bad_endpoints_are_refused(endpoint, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        DaemonConfig(endpoint=endpoint)


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:0", "tcp://*:*", "tcp://[::1]:65535", "ipc:///tmp/" + "y" * 102, "ipc://@a"],
)
def test_good_endpoints(endpoint):
    assert DaemonConfig(endpoint=endpoint).resolved_endpoint == endpoint


def test_default_ipc_path_too_long(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 100)
    deep.mkdir(mode=0o700)
    monkeypatch.setenv("SHMBUFFER_RUNTIME_DIR", str(deep))
    with pytest.raises(ConfigError, match="SHMBUFFER_RUNTIME_DIR"):
        DaemonConfig().resolved_endpoint  # noqa: B018


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, -1.0, "30", True])
@pytest.mark.parametrize("setting", ["lease_ttl", "reservation_ttl", "client_idle_ttl"])
def test_ttls_must_be_positive_finite_numbers(setting, value):
    with pytest.raises(ConfigError, match=f"{setting} must be a positive, finite number"):
        DaemonConfig(**{setting: value})


def test_flags_must_be_booleans():
    with pytest.raises(ConfigError, match="insecure_tcp must be true or false"):
        DaemonConfig(insecure_tcp="false")
