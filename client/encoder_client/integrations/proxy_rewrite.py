"""What the EPD proxy does to a ``/v1/chat/completions`` body, free of aiohttp and of any I/O.

The proxy (``encoder_client.integrations.proxy``) finds every image part, gets its bytes (a
``data:`` URL here; an http(s) URL is fetched by the proxy, from allowed hosts only), has the
encoder encode it and rewrites the part with ``"uuid": <content hash>``: vLLM 0.33.0's chat parser
(``vllm/renderers/chat_utils/chat_message.py``, ``parse_chat_message_content_mm_part``) reads the
``uuid`` key beside ``image_url`` and, with no ``mm_processor_kwargs`` / ``media_io_kwargs`` in
the request, uses it verbatim as the item's ``mm_hash``: the key our vLLM connector fetches by.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CONTENT_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
# Request keys that make vLLM hash the uuid with them, so the key no longer names our embedding.
CONTRACT_BREAKING_KEYS = ("mm_processor_kwargs", "media_io_kwargs")
MM_KWARGS_POLICIES = ("refuse", "strip")


class ProxyRequestError(Exception):
    """A request the proxy answers itself, with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 413: "RequestEntityTooLarge", 502: "BadGateway",
                503: "ServiceUnavailable"}.get(self.status, "ProxyError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


@dataclass
class ImagePart:
    """One image content part of the request: where it is, and its URL as sent."""

    where: str  # "messages[1].content[0]", for error messages
    part: dict[str, Any]
    url: str  # "" for a part that names its image by uuid alone
    uuid: str | None = None  # the client's own uuid of a part without an image


def bad_request(message: str, param: str | None = None) -> ProxyRequestError:
    return ProxyRequestError(400, message, param)


def _part_url(part: dict[str, Any], where: str) -> str:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}: image_url has no url (the proxy needs the image itself to encode it)", where)
    return url


def _has_no_image(part: dict[str, Any]) -> bool:
    image_url = part.get("image_url")
    return image_url is None or (isinstance(image_url, dict) and image_url.get("url") is None)


def image_parts(body: dict[str, Any]) -> list[ImagePart]:
    """Every ``image_url`` part of every message, in order."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list", "messages")
    found: list[ImagePart] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind == "image_url" or (kind is None and "image_url" in part):
                where = f"messages[{i}].content[{j}]"
                if _has_no_image(part) and isinstance(part.get("uuid"), str) and part["uuid"]:
                    found.append(ImagePart(where, part, "", part["uuid"]))  # by reference: checked with the encoder
                else:
                    found.append(ImagePart(where, part, _part_url(part, where)))
    return found


def apply_mm_kwargs_policy(body: dict[str, Any], policy: str) -> list[str]:
    """Refuse (400) or strip the request keys that break the uuid contract; the keys stripped."""
    present = [k for k in CONTRACT_BREAKING_KEYS if body.get(k)]
    if not present:
        return []
    if policy == "strip":
        for key in present:
            del body[key]
        return present
    raise bad_request(
        f"{' and '.join(present)} not supported through the EPD proxy: vLLM would hash each image's uuid "
        f"with them, and the key would no longer name the encoder's embedding (the encoder preprocesses "
        f"with its own fixed settings); send the request without them, or start the proxy with "
        f"--mm-kwargs strip to have them removed", present[0])


def decode_data_url(url: str, where: str, max_bytes: int) -> tuple[str, bytes]:
    """``data:<mime>;base64,<data>`` -> (mime, bytes); a 400 naming the part for anything else."""
    header, sep, data = url.partition(",")
    if not sep or not header.startswith("data:"):
        raise bad_request(f"{where}: not a data URL (expected data:<mime>;base64,<data>)", where)
    params = header[len("data:"):].split(";")
    mime = params[0] or "application/octet-stream"
    if "base64" not in params[1:]:
        raise bad_request(f"{where}: data URL is not base64 (expected data:<mime>;base64,<data>)", where)
    if len(data) > (max_bytes * 4) // 3 + 4:
        raise ProxyRequestError(413, f"{where}: image larger than --max-image-bytes ({max_bytes} bytes)", where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise bad_request(f"{where}: bad base64 in data URL ({err})", where) from None
    if not raw:
        raise bad_request(f"{where}: data URL holds no bytes", where)
    return mime, raw


def to_data_url(mime: str, raw: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"


def rewrite_part(image: ImagePart, uuid: str, data_url: str | None) -> None:
    """The part as vLLM gets it: ``{"type": "image_url", "image_url": {"url": ...}, "uuid": ...}``.

    ``data_url`` None sends the uuid alone (``"image_url": null``): vLLM 0.33.0 accepts that only
    when its own processor cache already holds the uuid (else it answers 400 "Cache miss ... but
    data is not provided"), which is why the proxy forwards the pixels by default.
    """
    image.part.clear()
    image.part.update({"type": "image_url", "image_url": {"url": data_url} if data_url else None, "uuid": uuid})


class HostAllowList:
    """Hosts whose http(s) image URLs the proxy may fetch: ``cdn.example.com``, ``*.example.com``
    (``*`` is one whole label, never crossing a dot), ``10.0.0.*`` (IP patterns match only IP
    addresses, octet by octet) or ``*`` (any host). Empty: no URL is ever fetched."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = [p.strip().lower() for p in patterns if p.strip()]

    def __bool__(self) -> bool:
        return bool(self.patterns)

    @staticmethod
    def _is_ip(host: str) -> bool:
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return False
        return True

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for pattern in self.patterns:
            if pattern == "*":
                return True
            ip_pattern = all(label == "*" or label.isdigit() for label in pattern.split("."))
            if ip_pattern != self._is_ip(host):
                continue
            labels, wanted = host.split("."), pattern.split(".")
            if len(labels) == len(wanted) and all(w in ("*", h) for w, h in zip(wanted, labels, strict=True)):
                return True
        return False

