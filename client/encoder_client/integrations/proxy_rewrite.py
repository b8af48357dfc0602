"""What the EPD proxy does to a ``/v1/chat/completions`` body, free of aiohttp and of any I/O.

The proxy (``encoder_client.integrations.proxy``) finds every image part (``image_url``) and
every clip part (``video_url``), gets its bytes (a ``data:`` URL here; an http(s) URL is fetched by
the proxy, from allowed hosts only), has the encoder encode it and rewrites the part with
``"uuid": <content hash>``: vLLM 0.33.0's chat parser (``vllm/renderers/chat_utils/chat_message.py``,
``parse_chat_message_content_mm_part``) reads the ``uuid`` key beside ``image_url`` or
``video_url`` and, with no ``mm_processor_kwargs`` / ``media_io_kwargs`` in the request, uses it
verbatim as the item's ``mm_hash``: the key our vLLM connector fetches by.
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
# The content part types the proxy rewrites: images, and clips (sent to the encoder as
# ``Video(data, reference="vllm", fps=--video-fps)``, or, for vLLM's video/jpeg data URL of a clip's
# frames, ``Video(frames=..., reference="vllm")``: vLLM takes such frames as they come).
MEDIA_KINDS = ("image_url", "video_url")


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
class MediaPart:
    """One image (``image_url``) or clip (``video_url``) content part of the request: where it
    is, and its URL as sent."""

    where: str  # "messages[1].content[0]", for error messages
    part: dict[str, Any]
    url: str  # "" for a part that names its image by uuid alone
    uuid: str | None = None  # the client's own uuid of a part without an image
    kind: str = "image_url"  # or "video_url"

    @property
    def is_video(self) -> bool:
        return self.kind == "video_url"

    @property
    def noun(self) -> str:
        """What the part holds, for messages: "image" or "clip"."""
        return "clip" if self.is_video else "image"


def bad_request(message: str, param: str | None = None) -> ProxyRequestError:
    return ProxyRequestError(400, message, param)


def _part_url(part: dict[str, Any], where: str, kind: str) -> str:
    media_url = part.get(kind)
    url = media_url.get("url") if isinstance(media_url, dict) else media_url
    if not isinstance(url, str) or not url:
        noun = "clip" if kind == "video_url" else "image"
        raise bad_request(f"{where}: {kind} has no url (the proxy needs the {noun} itself to encode it)", where)
    return url


def _has_no_media(part: dict[str, Any], kind: str) -> bool:
    media_url = part.get(kind)
    return media_url is None or (isinstance(media_url, dict) and media_url.get("url") is None)


def _part_kind(part: dict[str, Any]) -> str | None:
    kind = part.get("type")
    if kind in MEDIA_KINDS:
        return kind
    if kind is None:  # vLLM's parser takes a part without a type by its URL key
        return next((k for k in MEDIA_KINDS if k in part), None)
    return None


def media_parts(body: dict[str, Any]) -> list[MediaPart]:
    """Every ``image_url`` and ``video_url`` part of every message, in order."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list", "messages")
    found: list[MediaPart] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            kind = _part_kind(part)
            if kind is not None:
                where = f"messages[{i}].content[{j}]"
                if _has_no_media(part, kind) and isinstance(part.get("uuid"), str) and part["uuid"]:
                    # by reference: checked with the encoder
                    found.append(MediaPart(where, part, "", part["uuid"], kind))
                else:
                    found.append(MediaPart(where, part, _part_url(part, where, kind), kind=kind))
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


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"  # a URL scheme is case-insensitive, and vLLM takes any case


def _data_url_parts(url: str) -> tuple[str, str] | None:
    """(media type, data) of a base64 data URL as vLLM's MediaConnector._load_data_url splits it (the
    encoding is what follows the last ';', exactly base64), or None."""
    if not is_data_url(url):
        return None
    spec, sep, data = url[5:].partition(",")
    media, sep2, encoding = spec.rpartition(";")
    if not sep or not sep2 or encoding != "base64":
        return None
    return media.partition(";")[0], data


def decode_data_url(url: str, where: str, max_bytes: int, noun: str = "image",
                    limit_flag: str = "--max-image-bytes") -> tuple[str, bytes]:
    """``data:<mime>;base64,<data>`` -> (mime, bytes); a 400 naming the part for anything else, a
    413 for more than ``max_bytes`` (``limit_flag``; ``noun`` says what the part holds)."""
    if "," not in url or not is_data_url(url):
        raise bad_request(f"{where}: not a data URL (expected data:<mime>;base64,<data>)", where)
    parts = _data_url_parts(url)
    if parts is None:
        raise bad_request(f"{where}: data URL is not base64 (expected data:<mime>;base64,<data>)", where)
    mime, data = parts[0] or "application/octet-stream", parts[1]
    if len(data) > (max_bytes * 4) // 3 + 4:
        raise ProxyRequestError(413, f"{where}: {noun} larger than {limit_flag} ({max_bytes} bytes)", where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise bad_request(f"{where}: bad base64 in data URL ({err})", where) from None
    if not raw:
        raise bad_request(f"{where}: data URL holds no bytes", where)
    return mime, raw


FRAMES_MIME = "video/jpeg"  # vLLM's data URL of a clip's frames: data:video/jpeg;base64,<frame>,<frame>,...
# vLLM keeps the first 32 frames of such a URL (VideoMediaIO's num_frames; only --media-io-kwargs changes
# it, which breaks the uuid contract) and never reads the rest: so do we, or the uuid names other frames.
VLLM_URL_FRAMES = 32


def is_frames_data_url(url: str) -> bool:
    """Whether vLLM reads ``url`` as a clip's frames (its media type, lowercased, is video/jpeg; vLLM
    neither strips it nor takes another encoding than base64)."""
    parts = _data_url_parts(url)
    return parts is not None and parts[0].lower() == FRAMES_MIME


def decode_frames_data_url(url: str, where: str, max_bytes: int, limit_flag: str = "--max-video-bytes"
                           ) -> list[bytes]:
    """The frames vLLM takes from its ``data:video/jpeg;base64,<frame>,<frame>,...`` (each an encoded image
    in base64, the first ``VLLM_URL_FRAMES`` of them, as vLLM splits them): their bytes; a 400 naming
    the part for a frame that is not base64 or empty, a 413 past ``max_bytes`` in all."""
    parts = _data_url_parts(url)
    if parts is None:
        raise bad_request(f"{where}: a video/jpeg data URL must be base64 (data:video/jpeg;base64,<frame>,...)",
                          where)
    kept = parts[1].split(",", VLLM_URL_FRAMES)[:VLLM_URL_FRAMES]
    if sum(len(part) for part in kept) > (max_bytes * 4) // 3 + 4 * len(kept):
        raise ProxyRequestError(413, f"{where}: clip larger than {limit_flag} ({max_bytes} bytes)", where)
    frames = []
    for n, part in enumerate(kept):
        try:
            frame = base64.b64decode(part, validate=True)
        except (binascii.Error, ValueError) as err:
            raise bad_request(f"{where}: frame {n} of the video/jpeg data URL is not base64 ({err})", where) from None
        if not frame:
            raise bad_request(f"{where}: frame {n} of the video/jpeg data URL is empty", where)
        frames.append(frame)
    if sum(len(f) for f in frames) > max_bytes:
        raise ProxyRequestError(413, f"{where}: clip larger than {limit_flag} ({max_bytes} bytes)", where)
    return frames


def to_data_url(mime: str, raw: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"


def rewrite_part(media: MediaPart, uuid: str, data_url: str | None) -> None:
    """The part as vLLM gets it: ``{"type": "image_url", "image_url": {"url": ...}, "uuid": ...}``
    (``video_url`` for a clip).

    ``data_url`` None sends the uuid alone (``"image_url": null``): vLLM 0.33.0 accepts that only
    when its own processor cache already holds the uuid (else it answers 400 "Cache miss ... but
    data is not provided"), which is why the proxy forwards the pixels by default.
    """
    media.part.clear()
    media.part.update({"type": media.kind, media.kind: {"url": data_url} if data_url else None, "uuid": uuid})


class HostAllowList:
    """Hosts whose http(s) image and clip URLs the proxy may fetch: ``cdn.example.com``, ``*.example.com``
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

