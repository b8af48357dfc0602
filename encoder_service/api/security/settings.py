"""The server's security settings, built once at start-up: TLS credentials of the gRPC port and toward
the sinks, the interceptors (bearer tokens, per-client limits) of the gRPC port and, from the same
settings, of the SGLang port, and what the start-up log says about them.

Everything that reads a file happens here, before any port is bound, so a wrong path or a bad
certificate stops the start with a message naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from ...config import SecurityConfig, SglangConfig
from ..relay.regions import RegionBoard
from .auth import TokenAuthInterceptor, TokenFile, TokenFileError
from .client_limits import ConcurrencyLimits, PerClientLimitInterceptor
from .tls import ReloadingServerCredentials, TLSFileError, sink_channel_credentials

SecurityFileError = (TLSFileError, TokenFileError)


@dataclass
class Security:
    tls: ReloadingServerCredentials | None = None
    tokens: TokenFile | None = None
    interceptors: list[grpc.aio.ServerInterceptor] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)
    client_limits: ConcurrencyLimits | None = None  # per-client counts, shared with the SGLang port
    sink_credentials: grpc.ChannelCredentials | None = None  # toward the sinks (--sink-tls-*); None: plaintext


@dataclass
class PortSecurity:
    """Another port's share of the settings (the SGLang port's, api/sglang/front_end.py)."""

    interceptors: list[grpc.aio.ServerInterceptor]
    by_token: bool  # tokens are checked there: a caller is its token
    summary: list[str]


def build_security(config: SecurityConfig, relay_regions: RegionBoard | None = None) -> Security:
    """Raises TLSFileError / TokenFileError (both ValueErrors) naming the file that is wrong.
    ``relay_regions``: the relay processes' regions, behind ``--grpc-processes``."""
    s = Security()
    if config.tls:
        s.tls = ReloadingServerCredentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        s.summary.append(f"TLS on (certificate {config.tls_cert}, re-read when it changes)")
        s.summary.append(f"mTLS on (client certificates must be signed by {config.tls_client_ca})"
                         if s.tls.mutual else "mTLS off")
    else:
        s.summary.append("TLS off (plaintext gRPC), mTLS off")
    if config.auth_token_file:
        s.tokens = TokenFile(config.auth_token_file)
        s.interceptors.append(TokenAuthInterceptor(s.tokens))
        s.summary.append(f"bearer-token auth on ({s.tokens.count} tokens from {config.auth_token_file}; "
                         "health and reflection open)")
    else:
        s.summary.append("bearer-token auth off")
    if config.max_requests_per_client > 0:
        # After the token check: a client is identified by a token only once it was accepted.
        limiter = PerClientLimitInterceptor(config.max_requests_per_client, by_token=s.tokens is not None,
                                            relayed=config.relayed, relay_regions=relay_regions)
        s.interceptors.append(limiter)
        s.client_limits = limiter.limits
        s.summary.append(f"at most {config.max_requests_per_client} concurrent Encode calls per client "
                         f"(by {'token' if s.tokens else 'IP address'})")
    if config.sink_tls:
        s.sink_credentials = sink_channel_credentials(config)  # read and checked now; the servicer is handed them
        s.summary.append("TLS toward sinks on" + (" (mTLS: client certificate " + config.sink_tls_cert + ")"
                                                   if config.sink_tls_cert else ""))
    return s


def sglang_port_security(sglang: SglangConfig, config: SecurityConfig, security: Security,
                         limited_methods: frozenset[str]) -> PortSecurity:
    """The SGLang port's interceptors, from the same settings as the main port's: the same token
    file (unless ``--sglang-compat-tokens off``: SGLang's client sends no token) and the same
    per-client counts (``limited_methods``: that port's Encode). Two groups: the port's own
    setting (``sglang``) and the main port's security settings it shares (``config``)."""
    interceptors: list[grpc.aio.ServerInterceptor] = []
    summary = []
    tokens = security.tokens if sglang.tokens == "on" else None
    if tokens is not None:
        interceptors.append(TokenAuthInterceptor(tokens))
        summary.append("bearer-token auth on (--auth-token-file)")
    else:
        summary.append("bearer-token auth off" + (" (--sglang-compat-tokens off)" if security.tokens else ""))
    if config.max_requests_per_client > 0:
        interceptors.append(PerClientLimitInterceptor(config.max_requests_per_client, by_token=tokens is not None,
                                                      methods=limited_methods, limits=security.client_limits))
        summary.append(f"at most {config.max_requests_per_client} concurrent Encode calls per client, both ports "
                       f"together (by {'token' if tokens is not None else 'IP address'} here)")
    return PortSecurity(interceptors, tokens is not None, summary)
