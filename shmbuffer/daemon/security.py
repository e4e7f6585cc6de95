"""Access control: who may open a buffer's segment, reach its socket, and talk to it over tcp.

- **Local (default)**: segment files and the ipc socket are owner-only (``0600``; folders
  ``0700``), and so is the local lane beside the socket (``daemon/lane.py``: the same mode
  and group as the socket, never opened beside CURVE, which it would bypass). Only processes
  of the daemon's user can map the rows or send requests.
- **Group** (``--group NAME|GID``): the segment folder becomes ``0750`` and its files ``0660``
  (writers *and* readers map the data file read-write: readers bump nothing, but the mapping is
  shared and writable), the ipc socket ``0660``, all owned by that group. Members find the
  daemon by name with nothing set: it publishes its runtime record in the group's discovery
  folder ``/tmp/shmbuffer-g<gid>/<uid>/`` (``3770`` and ``0750``; checked by every client, see
  ``shmbuffer/runtime.py``), and its default ipc socket lives there too. The runtime dir is
  opened to the group as well (``0750``, only when it is a private folder of the daemon's
  user), so pointing ``SHMBUFFER_RUNTIME_DIR`` at it still works.
- **tcp** is opt-in. With ``--curve-secret`` the ROUTER is a ZeroMQ CURVE server: clients must
  know its public key (and, with ``--curve-clients DIR``, hold a certificate whose public key
  is in ``DIR``). Without keys, only a loopback address may be bound (with a warning: any local
  user can connect), unless ``--insecure-tcp`` says otherwise.
- **Admin requests** (``clear``, ``shutdown``, ``checkpoint``): the ``admin`` role is only what
  a client claims in its hello, so the transport must vouch for it: the owner-only (or group)
  ipc socket, or CURVE. On tcp without CURVE they are refused unless ``--insecure-tcp-admin``;
  ``stats`` stays readable by any client (:func:`admin_refusal`).

Everything here is small and side-effect free where it can be, so the policy is unit-tested
without a daemon (``tests/test_security.py``).
"""

from __future__ import annotations

import contextlib
import grp
import ipaddress
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from shmbuffer.errors import InsecureEndpointError, KeyFileError
from shmbuffer.wire.curve import load_secret_cert

log = logging.getLogger("shmbuffer.daemon")

ZAP_DOMAIN = "shmbuffer"


# -- tcp policy -------------------------------------------------------------------------------


def tcp_host(endpoint: str) -> str | None:
    """The host part of a ``tcp://HOST:PORT`` endpoint (brackets stripped), else None."""
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://") :]
    if ";" in rest:  # tcp://SOURCE;DEST: what is bound/connected is DEST
        rest = rest.rsplit(";", 1)[1]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` is reachable from this machine only."""
    if host.lower() in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname, an interface name or "*": assume it is reachable


def check_tcp_endpoint(endpoint: str, curve: bool, insecure: bool) -> list[str]:
    """Warnings to log before binding ``endpoint``; raises :class:`InsecureEndpointError` when
    a tcp endpoint would be reachable from other hosts without CURVE and ``insecure`` is False.
    Non-tcp endpoints (ipc, inproc) need nothing."""
    host = tcp_host(endpoint)
    if host is None or curve:
        return []
    if is_loopback(host):
        return [
            f"{endpoint} has no CURVE authentication: any local user can connect to it "
            "(the default ipc socket is owner-only); use --curve-secret to require keys"
        ]
    if not insecure:
        raise InsecureEndpointError(
            f"refusing to bind {endpoint} without authentication: anyone who can reach this "
            "host could read and overwrite the buffer. Create keys with `shmbuffer-daemon "
            "keygen` and pass --curve-secret (and --curve-clients), bind tcp://127.0.0.1:PORT, "
            "or pass --insecure-tcp if the network is trusted"
        )
    return [
        f"INSECURE: {endpoint} accepts unauthenticated clients from the network "
        "(--insecure-tcp); anyone who can reach it can read and overwrite the buffer"
    ]


#: Requests that change or end the whole buffer: the admin role alone is not enough for them.
ADMIN_OPS = ("clear", "shutdown", "checkpoint")


def admin_refusal(endpoint: str, curve: bool, allow_tcp_admin: bool) -> str | None:
    """Why :data:`ADMIN_OPS` are refused on the bound ``endpoint``, or None if they are not.

    Allowed on ipc (the socket file is ``0600``, or ``0660`` for the ``--group`` the daemon
    trusts) and with CURVE (the client holds a key; with ``--curve-clients``, an allowed one).
    A tcp socket without CURVE admits every local user, and with ``--insecure-tcp`` the
    network: there only ``allow_tcp_admin`` (``--insecure-tcp-admin``) lets them through."""
    if tcp_host(endpoint) is None or curve or allow_tcp_admin:
        return None
    return (
        f"{endpoint} has no CURVE authentication, so any user who can connect could claim the "
        "admin role; stop the daemon with SIGTERM (`shmbuffer-daemon stop` falls back to it), "
        "use the ipc socket or --curve-secret, or start the daemon with --insecure-tcp-admin"
    )


def check_daemon_access(config: Any) -> list[str]:
    """Check a ``DaemonConfig`` before anything is created: the tcp policy, the group and the
    key files. Returns the warnings to log; raises on a setting that cannot be honoured. With
    a group, the group's discovery folder is made (or checked) here, before the segment: the
    default socket is bound in it, and one we cannot trust stops the start."""
    gid = resolve_group(config.group)
    if gid is not None:
        from shmbuffer.runtime import ensure_group_dir

        ensure_group_dir(gid)
    if config.curve_clients and not config.curve_secret:
        raise KeyFileError("--curve-clients needs --curve-secret (the server's own keys)")
    if config.curve_secret:
        load_secret_cert(config.curve_secret)
    if config.curve_clients and not Path(config.curve_clients).is_dir():
        raise KeyFileError(f"--curve-clients {config.curve_clients} is not a folder")
    endpoint, curve = config.resolved_endpoint, bool(config.curve_secret)
    warnings = check_tcp_endpoint(endpoint, curve, bool(config.insecure_tcp))
    if config.insecure_tcp_admin and admin_refusal(endpoint, curve, False):
        warnings.append(
            f"INSECURE: any client of {endpoint} may {', '.join(ADMIN_OPS)} (--insecure-tcp-admin)"
        )
    return warnings


# -- groups and file modes --------------------------------------------------------------------


def resolve_group(group: str | int | None) -> int | None:
    """A gid from a group name or number (None stays None); unknown groups are an error."""
    if group is None or group == "":
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ValueError(f"unknown group {group!r}") from None


def segment_access(group: str | int | None) -> dict[str, Any]:
    """``Segment.create`` keyword arguments: owner-only, or read-write for ``group``."""
    gid = resolve_group(group)
    return {"file_mode": 0o600 if gid is None else 0o660, "group": gid}


def secure_ipc_path(path: str | os.PathLike[str], gid: int | None) -> None:
    """Set the final mode of a bound ipc socket file: ``0600``, or ``0660`` for ``gid``."""
    if gid is None:
        os.chmod(path, 0o600)
    else:
        os.chown(path, -1, gid)
        os.chmod(path, 0o660)


def share_with_group(path: str | os.PathLike[str], gid: int | None, mode: int) -> None:
    """Open a runtime file or folder of ours to ``gid`` (``mode`` bits are added, never
    removed). Left alone when ``gid`` is None, the path is someone else's, or it is already
    open to other users (``/tmp`` and the like)."""
    if gid is None:
        return
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o007:
        return
    os.chown(path, -1, gid)
    os.chmod(path, stat.S_IMODE(st.st_mode) | mode)


def share_runtime(config: Any) -> None:
    """With a group: the runtime record is published in the group's discovery folder, where
    members find it by name (``runtime.publish_to_group``); the runtime dir (``0750``) and the
    buffer's runtime and pid files (``0640``) become readable by the group too, for members
    who set ``SHMBUFFER_RUNTIME_DIR`` to that folder."""
    gid = resolve_group(config.group)
    if gid is None:
        return
    from shmbuffer.runtime import publish_to_group, runtime_dir

    publish_to_group(config.name, gid)
    folder = runtime_dir()
    share_with_group(folder, gid, 0o050)
    for suffix in (".json", ".pid"):
        with contextlib.suppress(FileNotFoundError):
            share_with_group(folder / f"{config.name}{suffix}", gid, 0o040)


# -- sockets ----------------------------------------------------------------------------------


@dataclass
class ServerSecurity:
    """What :meth:`Server._bind` set up; :meth:`close` stops the authenticator thread."""

    curve: bool = False
    authenticator: Any = None

    def close(self) -> None:
        if self.authenticator is not None:
            with contextlib.suppress(Exception):
                self.authenticator.stop()
            self.authenticator = None


def make_curve_server(
    context: zmq.Context[Any],
    socket: zmq.Socket[Any],
    secret_file: str | os.PathLike[str],
    clients_dir: str | os.PathLike[str] | None,
) -> ServerSecurity:
    """Make ``socket`` (not yet bound) a CURVE server with the keys in ``secret_file``.

    With ``clients_dir``, a ZAP authenticator thread on ``context`` admits only clients whose
    public key is one of the ``*.key`` files there; without it, any client that knows the
    server's public key is admitted."""
    public, secret = load_secret_cert(secret_file)
    auth = None
    if clients_dir is not None:
        if not Path(clients_dir).is_dir():
            raise KeyFileError(f"--curve-clients {clients_dir} is not a folder")
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(context, log=logging.getLogger("shmbuffer.daemon.auth"))
        auth.start()
        auth.configure_curve(domain=ZAP_DOMAIN, location=os.fspath(clients_dir))
        socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
    return ServerSecurity(curve=True, authenticator=auth)
