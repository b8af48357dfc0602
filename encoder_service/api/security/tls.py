"""TLS (and mutual TLS) of the gRPC port, with certificates re-read when their files change.

gRPC does the reloading itself: ``grpc.dynamic_ssl_server_credentials`` asks a fetcher for the
certificate configuration at every new TLS handshake, and the fetcher answers None (keep the one in
use) unless the files changed. cert-manager and kubelet rotate a Secret's files in place, so a
rotation reaches new connections without a restart; connections already open keep the certificate
they were made with.

Every configuration is checked with Python's ``ssl`` module before gRPC gets it: the certificate and
key parse and belong together, the CA bundle parses. At start-up a bad file fails with its name;
later (a rotation caught half-written, e.g. the new certificate beside the old key) the new files
are refused, the old configuration stays in use, and the next handshake looks again.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass

import grpc

from ...config import SecurityConfig

log = logging.getLogger(__name__)


class TLSFileError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the file."""


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TLSFileError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise TLSFileError(f"{what} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def _no_password(*_args: object) -> bytes:
    raise TLSFileError("encrypted private keys are not supported")


def _check_pair(cert_path: str, key_path: str) -> None:
    """The certificate and key parse and match (ssl does the work; no crypto library needed)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_path, key_path, password=_no_password)
    except (ssl.SSLError, TLSFileError) as exc:
        raise TLSFileError(f"certificate {cert_path} with key {key_path}: not a usable pair "
                           f"(unparsable, encrypted, or the key does not match the certificate): {exc}") from None


def _check_ca(ca_path: str, what: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=ca_path)
    except ssl.SSLError as exc:
        raise TLSFileError(f"{what} {ca_path}: not a PEM CA certificate bundle: {exc}") from None


@dataclass(frozen=True)
class CertificateSet:
    """What one TLS configuration is made of, as bytes."""

    cert: bytes
    key: bytes
    client_ca: bytes | None


def load_certificates(cert_path: str, key_path: str, client_ca_path: str = "") -> CertificateSet:
    """Reads and checks the files; raises TLSFileError naming the file that is wrong."""
    cert = _read(cert_path, "tls-cert")
    key = _read(key_path, "tls-key")
    client_ca = _read(client_ca_path, "tls-client-ca") if client_ca_path else None
    _check_pair(cert_path, key_path)
    if client_ca_path:
        _check_ca(client_ca_path, "tls-client-ca")
    # ssl checked the files, not our bytes: a rotation between the two reads would pass a pair
    # that was never checked together.
    if (_read(cert_path, "tls-cert"), _read(key_path, "tls-key")) != (cert, key):
        raise TLSFileError(f"tls-cert {cert_path} / tls-key {key_path}: changed while being read")
    return CertificateSet(cert, key, client_ca)


def sink_channel_credentials(config: SecurityConfig) -> grpc.ChannelCredentials | None:
    """Credentials toward EmbeddingSinks from --sink-tls-*; None (plaintext) when none is set."""
    if not config.sink_tls:
        return None
    return channel_credentials_from_files(config.sink_tls_ca, config.sink_tls_cert, config.sink_tls_key)


def _configuration(certs: CertificateSet) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(certs.key, certs.cert)], root_certificates=certs.client_ca)


class ReloadingServerCredentials:
    """Server credentials whose certificate configuration follows the files.

    ``fetch`` is gRPC's certificate_configuration_fetcher: called from gRPC's own threads at each
    handshake, it looks at the files' stat (cheap) and re-reads only when one changed; a changed
    set whose bytes are the same as the one in use is not handed to gRPC again.
    """

    def __init__(self, cert_path: str, key_path: str, client_ca_path: str = "") -> None:
        self.paths = tuple(p for p in (cert_path, key_path, client_ca_path) if p)
        self._cert_path, self._key_path, self._client_ca_path = cert_path, key_path, client_ca_path
        self._lock = threading.Lock()
        self.current = load_certificates(cert_path, key_path, client_ca_path)
        self._stamp = self._stat()
        self.reloads = 0
        self.credentials = grpc.dynamic_ssl_server_credentials(
            _configuration(self.current), self.fetch, require_client_authentication=bool(client_ca_path))

    @property
    def mutual(self) -> bool:
        return bool(self._client_ca_path)

    def _stat(self) -> tuple:
        stamp = []
        for path in self.paths:
            try:
                st = os.stat(path)  # follows symlinks: a Secret volume swaps its ..data link
                stamp.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                stamp.append(None)
        return tuple(stamp)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            return self._fetch()
        except Exception:  # an exception here would fail the handshake inside gRPC; keep serving
            log.exception("checking the TLS certificate files failed; keeping the certificates in use")
            return None

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = self._stat()
        with self._lock:
            if stamp == self._stamp:
                return None
            try:
                certs = load_certificates(self._cert_path, self._key_path, self._client_ca_path)
            except TLSFileError as exc:
                # Not remembered as seen: the next handshake looks again (the rest of a rotation
                # may land a moment later).
                log.warning("TLS files changed but cannot be used yet, keeping the certificates in use: %s", exc)
                return None
            self._stamp = stamp
            if certs == self.current:
                return None
            self.current = certs
            self.reloads += 1
        log.info("TLS certificates reloaded from %s", ", ".join(self.paths))
        return _configuration(certs)


def channel_credentials_from_files(ca_path: str = "", cert_path: str = "", key_path: str = "",
                                   what: str = "sink-tls") -> grpc.ChannelCredentials:
    """Client-side credentials (the server's TLS toward EmbeddingSinks): CA bundle (None: the
    system's roots) and an optional client certificate for mutual TLS. Read once."""
    ca = None
    if ca_path:
        ca = _read(ca_path, f"{what}-ca")
        _check_ca(ca_path, f"{what}-ca")
    cert = key = None
    if cert_path:
        cert, key = _read(cert_path, f"{what}-cert"), _read(key_path, f"{what}-key")
        _check_pair(cert_path, key_path)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
