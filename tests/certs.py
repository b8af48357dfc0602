"""Test certificates made with the ``openssl`` command line (no crypto package is a dependency).

``make_ca(dir, "ca")`` -> a self-signed CA; ``ca.issue("server", server=True)`` -> a server
certificate for 127.0.0.1 / localhost; ``ca.issue("client")`` -> a client certificate. EC P-256
keys: generated in milliseconds.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_SAN = "IP:127.0.0.1,IP:::1,DNS:localhost"


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{result.stderr}")


def _key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes()


@dataclass(frozen=True)
class CA:
    directory: Path
    name: str
    cert: Path
    key: Path

    def issue(self, name: str, *, server: bool = False) -> Pair:
        stem = f"{self.name}-{name}"
        key, csr, cert, ext_file = (self.directory / f"{stem}.{ext}" for ext in ("key", "csr", "crt", "ext"))
        usage = "serverAuth" if server else "clientAuth"
        ext_file.write_text(f"basicConstraints=CA:FALSE\nextendedKeyUsage={usage}\n"
                            + (f"subjectAltName={SERVER_SAN}\n" if server else ""))
        _key(key)
        _openssl("req", "-new", "-key", str(key), "-subj", f"/CN={self.name}-{name}", "-out", str(csr))
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
                 "-CAcreateserial", "-days", "2", "-sha256", "-extfile", str(ext_file), "-out", str(cert))
        return Pair(cert, key)


def make_ca(directory: Path, name: str) -> CA:
    directory.mkdir(parents=True, exist_ok=True)
    key, cert = directory / f"{name}-ca.key", directory / f"{name}-ca.crt"
    _key(key)
    _openssl("req", "-x509", "-new", "-key", str(key), "-subj", f"/CN={name} test CA", "-days", "2",
             "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", str(cert))
    return CA(directory, name, cert, key)


def serial_of(pem: bytes) -> str:
    """The serial number of a PEM certificate (e.g. the one a server presented)."""
    result = subprocess.run(["openssl", "x509", "-noout", "-serial"], input=pem, capture_output=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.decode())
    return result.stdout.decode().strip().partition("=")[2]
