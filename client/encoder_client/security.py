"""Client credentials: TLS (and mutual TLS) from PEM files, and bearer tokens.

    creds = tls_credentials(ca="ca.crt")                                  # TLS, server checked by ca.crt
    creds = tls_credentials(ca="ca.crt", cert="me.crt", key="me.key")     # mutual TLS
    EncoderClient("encoder:50051", credentials=creds, token=read_token_file("token"))

``token`` sends ``authorization: Bearer <token>`` with every call (the server's
``--auth-token-file``). Files are read once, when the credentials are built: a client that must
follow a rotated certificate builds a new client.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import grpc

AUTHORIZATION = "authorization"

PathOrBytes = str | os.PathLike | bytes | None


def _pem(value: PathOrBytes, what: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        data = value
    else:
        try:
            with open(value, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ValueError(f"{what} {os.fspath(value)}: cannot read it: {exc.strerror or exc}") from None
    if data is not None and b"-----BEGIN " not in data:
        name = what if isinstance(value, bytes) else f"{what} {os.fspath(value)}"
        raise ValueError(f"{name}: not PEM (no '-----BEGIN' line)")
    return data


def tls_credentials(ca: PathOrBytes = None, cert: PathOrBytes = None,
                    key: PathOrBytes = None) -> grpc.ChannelCredentials:
    """Channel credentials from PEM files (paths) or PEM bytes.

    ``ca``: the CA bundle the server's certificate must chain to (None: the system's roots);
    ``cert`` and ``key``: this client's certificate and key, for a server that asks for one
    (``--tls-client-ca``); both or neither.
    """
    if (cert is None) != (key is None):
        raise ValueError("cert and key go together: give both (mutual TLS) or neither")
    root, chain, private = _pem(ca, "CA"), _pem(cert, "certificate"), _pem(key, "key")
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=private, certificate_chain=chain)


def read_token_file(path: str | os.PathLike) -> str:
    """The first token of a token file (one a line; blank lines and # comments skipped), the
    format of the server's --auth-token-file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"token file {os.fspath(path)}: cannot read it: {exc}") from None
    for line in lines:
        if line.strip() and not line.strip().startswith("#"):
            return line.strip()
    raise ValueError(f"token file {os.fspath(path)}: holds no token")


def call_metadata(metadata: Sequence[tuple[str, str]] | None, token: str | None) -> tuple[tuple[str, str], ...] | None:
    """metadata plus ``authorization: Bearer <token>`` when a token is given."""
    out = tuple(metadata or ())
    if token is not None:
        token = token.strip()
        if not token or any(c.isspace() for c in token):
            raise ValueError("token must be non-empty and hold no white space")
        if any(k.lower() == AUTHORIZATION for k, _ in out):
            raise ValueError("give either token= or an authorization entry in metadata, not both")
        out += ((AUTHORIZATION, f"Bearer {token}"),)
    return out or None
