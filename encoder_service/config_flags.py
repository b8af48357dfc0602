"""The flags and environment variables of ``serve``, derived from ``ServiceConfig``'s fields, and the
start-up checks of the values they give: ``build_config`` is how the server gets its configuration.

A flag given on the command line wins over the environment, the environment over the default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import Field, fields

from .config import ENV_PREFIX, ServiceConfig, check_devices
from .preprocess.decoders import IMAGE_DECODERS


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _typ(f: Field):
    return str.upper if f.name == "log_level" else type(f.default)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per ServiceConfig field, in field order; defaults stay None so the environment
    can fill them."""
    for f in fields(ServiceConfig):
        env = ENV_PREFIX + f.name.upper()
        shown = repr(f.default) if f.default != "" else "none"  # unresolved: -1 reads "by device"
        parser.add_argument("--" + _flag(f.name), dest=f.name, type=_typ(f), default=None, metavar=f.name.upper(),
                            choices=f.metadata["choices"], help=f"{f.metadata['help']} [env {env}; default {shown}]")


def build_config(args: argparse.Namespace | None = None,
                 environ: Mapping[str, str] | None = None) -> ServiceConfig:
    """Flags over environment over defaults; raises ValueError on a bad environment value."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for f in fields(ServiceConfig):
        flag_value = getattr(args, f.name, None) if args is not None else None
        if flag_value is not None:
            values[f.name] = flag_value
            continue
        env_value = environ.get(ENV_PREFIX + f.name.upper())
        if env_value is not None and env_value != "":
            try:
                value = _typ(f)(env_value)
            except ValueError as exc:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={env_value!r}: {exc}") from None
            choices = f.metadata["choices"]
            if choices and value not in choices:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={env_value!r}: choose from {', '.join(choices)}")
            values[f.name] = value
    config = ServiceConfig(**values)
    _check(config)
    return config


# Options whose -1 stays in the config and is resolved by the engine from the model it serves.
_DERIVED_AT_START = ("max_image_pixels",)


def _check(c: ServiceConfig) -> None:
    problems = []
    for f in fields(ServiceConfig):
        value, meta = getattr(c, f.name), f.metadata
        note = f" ({meta['note']})" if meta["note"] else ""
        derived = value == -1 and f.name in _DERIVED_AT_START  # resolved once the model is known
        if meta["at_least"] is not None and value < meta["at_least"] and not derived:
            problems.append(f"{_flag(f.name)} must be >= {meta['at_least']}{note}")
        if meta["above"] is not None and value <= meta["above"]:
            problems.append(f"{_flag(f.name)} must be > {meta['above']}{note}")
    problems.extend(check_devices(c.devices))
    if c.decode_in == "workers" and not c.devices.strip():
        problems.append("decode-in workers needs --devices: without it no worker process runs")
    if c.decode_in == "workers" and IMAGE_DECODERS[c.decode].on_device:
        problems.append(f"decode-in workers is where a CPU decoder runs; --decode {c.decode} decodes on the device")
    try:
        _ = c.cuda_graph_budgets
    except ValueError as exc:
        problems.append(str(exc))
    for allowlist in ("sink_allowlist", "url_fetch_allowlist"):
        try:
            getattr(c, allowlist)
        except ValueError as exc:
            problems.append(str(exc))
    if not 0 <= c.port <= 65535:
        problems.append("port must be in 0..65535")
    problems.extend(_check_security(c))
    if problems:
        raise ValueError("; ".join(problems))


def _check_security(c: ServiceConfig) -> list[str]:
    """Combinations only; whether the files exist and parse is checked when they are loaded
    (api/security/tls.py, api/security/auth.py), so the message can name the file and what is wrong with it."""
    problems = []
    if bool(c.tls_cert) != bool(c.tls_key):
        problems.append("tls-cert and tls-key go together: give both (TLS) or neither (plaintext)")
    if c.tls_client_ca and not c.tls_cert:
        problems.append("tls-client-ca (mutual TLS) needs tls-cert and tls-key: the server must speak TLS")
    if bool(c.sink_tls_cert) != bool(c.sink_tls_key):
        problems.append("sink-tls-cert and sink-tls-key go together: give both or neither")
    if not -1 <= c.health_port <= 65535:
        problems.append("health-port must be in 0..65535 (or -1: none)")
    elif c.health_port > 0 and c.health_port == c.port:
        problems.append(f"health-port {c.health_port} is the gRPC port; it needs a port of its own")
    if not -1 <= c.sglang_compat_port <= 65535:
        problems.append("sglang-compat-port must be in 0..65535 (or -1: none)")
    elif c.sglang_compat_port > 0 and c.sglang_compat_port in (c.port, c.health_port):
        problems.append(f"sglang-compat-port {c.sglang_compat_port} is taken by another port; it needs its own")
    return problems


def parse_serve_args(argv: Sequence[str] | None = None,
                     environ: Mapping[str, str] | None = None) -> ServiceConfig:
    """Convenience for tests and embedding: argv of ``serve`` (without the subcommand) -> config."""
    parser = argparse.ArgumentParser(prog="encoder-service serve")
    add_serve_arguments(parser)
    return build_config(parser.parse_args(argv), environ)
