"""CURVE key files and client socket options, shared by the daemon and its clients.

A daemon started with ``--curve-secret`` is a ZeroMQ CURVE server (``daemon/security.py``);
clients need its public key (argument or ``$SHMBUFFER_CURVE_SERVER_KEY``) and, when the daemon
checks client certificates, one of their own (``$SHMBUFFER_CURVE_CLIENT_CERT``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from shmbuffer.errors import KeyFileError

ENV_CURVE_SERVER_KEY = "SHMBUFFER_CURVE_SERVER_KEY"
ENV_CURVE_CLIENT_CERT = "SHMBUFFER_CURVE_CLIENT_CERT"
Z85_KEY_LEN = 40  # a 32-byte CURVE key in Z85 text


def keygen(
    out_dir: str | os.PathLike[str], name: str = "server", force: bool = False
) -> tuple[Path, Path]:
    """Write a CURVE keypair: ``NAME.key`` (public, ``0644``) and ``NAME.key_secret``
    (``0600``) in ``out_dir`` (created ``0700`` if missing). Refuses to overwrite unless
    ``force``."""
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"invalid key name {name!r}")
    out = Path(out_dir)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    if not force:
        for p in (public, secret):
            if p.exists():
                raise KeyFileError(f"{p} exists; pass --force to replace it")
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    old = os.umask(0o077)  # the secret is never readable by others, not even for a moment
    try:
        for p in (public, secret):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        pub_file, sec_file = zmq.auth.create_certificates(out, name)
    finally:
        os.umask(old)
    os.chmod(sec_file, 0o600)
    os.chmod(pub_file, 0o644)
    return Path(pub_file), Path(sec_file)


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot load a CURVE certificate from {path}: {exc}") from exc
    if not public or len(public) != Z85_KEY_LEN:
        raise KeyFileError(f"{path} holds no CURVE public key")
    return public, secret


def load_public_key(path_or_z85: str | bytes | os.PathLike[str]) -> bytes:
    """A server's public key (Z85) from a certificate file, or the 40-character Z85 text."""
    if isinstance(path_or_z85, bytes):
        path_or_z85 = path_or_z85.decode("ascii")
    text = os.fspath(path_or_z85)
    if len(text) == Z85_KEY_LEN and not os.path.exists(text):
        try:
            zmq.utils.z85.decode(text)
        except Exception as exc:
            raise KeyFileError(f"{text!r} is neither a key file nor a Z85 key") from exc
        return text.encode("ascii")
    return _load(text)[0]


def load_secret_cert(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """``(public, secret)`` from a ``.key_secret`` certificate; a public-only file is an error."""
    public, secret = _load(path)
    if not secret:
        raise KeyFileError(f"{path} has no secret key (pass the .key_secret file)")
    return public, secret


def client_curve_options(
    server_key: str | bytes | os.PathLike[str] | None = None,
    client_cert: str | os.PathLike[str] | None = None,
) -> dict[int, bytes]:
    """Socket options for a CURVE client (empty when no server key is given or set in
    ``$SHMBUFFER_CURVE_SERVER_KEY``). Without a client certificate (argument or
    ``$SHMBUFFER_CURVE_CLIENT_CERT``) an ephemeral keypair is used: enough for a daemon that
    checks only the server key."""
    server_key = server_key or os.environ.get(ENV_CURVE_SERVER_KEY) or None
    client_cert = client_cert or os.environ.get(ENV_CURVE_CLIENT_CERT) or None
    if server_key is None:
        if client_cert is not None:
            raise KeyFileError(
                "a CURVE client certificate needs the server's public key too "
                f"(curve_server_key= or ${ENV_CURVE_SERVER_KEY})"
            )
        return {}
    if client_cert is not None:
        public, secret = load_secret_cert(client_cert)
    else:
        public, secret = zmq.curve_keypair()
    return {
        zmq.CURVE_SERVERKEY: load_public_key(server_key),
        zmq.CURVE_PUBLICKEY: public,
        zmq.CURVE_SECRETKEY: secret,
    }
