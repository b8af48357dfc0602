"""Bearer-token authentication of the VisionEncoder calls (``--auth-token-file``).

Callers send ``authorization: Bearer <token>``; the token must be one of the file's lines. No
header (or not a bearer one): UNAUTHENTICATED; a token that is not in the file: PERMISSION_DENIED.
Health and reflection stay open (interceptors.OPEN_SERVICE_PREFIXES): probes carry no token.

gRPC ships call credentials for clients but no server-side token check, hence this interceptor.
Tokens are compared as SHA-256 digests with ``hmac.compare_digest`` against every accepted token,
all of them every time: neither the time taken nor an early exit tells a caller how close it came,
or which token matched. The file is re-read when its stat changes (a rotated Secret), looked at on
each call; only digests are kept in memory.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading

import grpc

from ...errors import PermissionDenied, Unauthenticated
from ..interceptor_support import OPEN_SERVICE_PREFIXES, metadata_value, refusal

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"  # gRPC metadata keys are lower case
BEARER = "bearer"


class TokenFileError(ValueError):
    """The token file cannot be used; the message names it."""


def parse_tokens(text: str) -> list[str]:
    """One token a line; blank lines and ``#`` comment lines ignored, surrounding spaces stripped."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def presented_token(details: grpc.HandlerCallDetails) -> str | None:
    """The token of an ``authorization: Bearer <token>`` header; None when there is none."""
    value = metadata_value(details, AUTHORIZATION)
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != BEARER or not token.strip():
        return None
    return token.strip()


def client_identity(token: str) -> str:
    """Who a token stands for in logs and per-client limits: a digest prefix, never the token."""
    return "token " + hashlib.sha256(token.encode()).hexdigest()[:12]


class TokenFile:
    """The accepted tokens, following the file.

    A file that cannot be read after start-up (a rotation mid-way) keeps the tokens last read, with
    a warning; a file that holds no token accepts none (fail closed). At start-up both fail.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._digests = self._load(startup=True)

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _load(self, startup: bool = False) -> list[bytes]:
        try:
            with open(self.path, encoding="utf-8") as f:
                tokens = parse_tokens(f.read())
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"auth-token-file {self.path}: cannot read it: {exc}") from None
        if not tokens and startup:
            raise TokenFileError(f"auth-token-file {self.path}: holds no token (one a line; blank lines "
                                 "and # comments are ignored)")
        if not tokens:
            log.warning("auth-token-file %s holds no token now: every call is refused", self.path)
        if any(any(c.isspace() for c in t) for t in tokens):
            raise TokenFileError(f"auth-token-file {self.path}: a token contains white space "
                                 "(one token a line)")
        return [_digest(t) for t in tokens]

    @property
    def count(self) -> int:
        return len(self._digests)

    def _refresh(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            try:
                digests = self._load()
            except TokenFileError as exc:
                log.warning("%s; keeping the %d tokens read before", exc, len(self._digests))
                return  # not remembered as seen: the next call looks again
            self._stamp, self._digests = stamp, digests
        log.info("auth-token-file %s re-read: %d tokens", self.path, len(digests))

    def accepts(self, token: str) -> bool:
        self._refresh()
        presented = _digest(token)
        matched = False
        for accepted in self._digests:  # every one, no early exit
            matched |= hmac.compare_digest(presented, accepted)
        return matched


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: TokenFile) -> None:
        self.tokens = tokens

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICE_PREFIXES):
            return handler
        token = presented_token(details)
        if token is None:
            return refusal(handler, Unauthenticated(
                "this server requires a bearer token: send metadata 'authorization: Bearer <token>'"))
        if not self.tokens.accepts(token):
            log.info("%s refused: the bearer token is not accepted (%s)", details.method, client_identity(token))
            return refusal(handler, PermissionDenied("the bearer token is not accepted by this server"))
        return handler
