"""SGLang's ``mm_items`` (strings, as its language server forwards ``image_url``s) -> image bytes.

Accepted: ``data:[<mediatype>];base64,<data>`` URLs, bare base64 (SGLang's ``load_image`` decodes
any other string as base64 too) and http(s) URLs of ``--allow-url-fetch`` hosts (api/sglang/url_fetch.py).
Local paths and ``file://`` URLs are never read. Each error names the item (``mm_items[i]``).

``sglang_content_hash`` is the digest SGLang's routers and processors use for
``mm_content_hashes``: ``sha256:`` and the hex SHA-256 of the media's raw bytes (the decoded data
URL, the downloaded body), as ``sglang.srt.multimodal.cache.identity`` computes it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib

from ...errors import EncoderError, InvalidInput
from .url_fetch import UrlFetcher

CONTENT_HASH_PREFIX = "sha256:"


def sglang_content_hash(data: bytes) -> str:
    return CONTENT_HASH_PREFIX + hashlib.sha256(data).hexdigest()


def _b64(text: str, what: str, kind: str) -> bytes:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{what}: {kind} is not valid base64") from None
    if not data:
        raise InvalidInput(f"{what}: {kind} is empty")
    return data


def _data_url(item: str, what: str) -> bytes:
    header, sep, payload = item.partition(",")
    if not sep:
        raise InvalidInput(f"{what}: data URL {item[:60]!r}... has no ',' before its data")
    if not header.endswith(";base64"):
        raise InvalidInput(f"{what}: data URL {header[:60]!r} is not base64 (expected data:image/...;base64,...)")
    return _b64(payload, what, "the data URL's payload")


async def _load(index: int, item: str, fetcher: UrlFetcher) -> bytes:
    what = f"mm_items[{index}]"
    if item.startswith("data:"):
        return _data_url(item, what)
    if item.startswith(("http://", "https://")):
        data = await fetcher.fetch(item, what)
        if not data:
            raise InvalidInput(f"{what}: {item[:120]!r} has an empty body")
        return data
    if item.startswith("file:") or item.startswith(("/", "./", "../")) or "://" in item[:16]:
        raise InvalidInput(f"{what}: {item[:120]!r} is neither a data URL nor an http(s) URL: this encoder "
                           "never reads local files; send the image as a data URL")
    if not item:
        raise InvalidInput(f"{what} is empty")
    return _b64(item, what, f"{item[:40]!r}... (neither a data URL nor an http(s) URL, so read as base64)")


async def load_mm_items(items: list[str], fetcher: UrlFetcher) -> list[bytes]:
    """Every item's bytes, in order; fetches run concurrently. The first error (in item order) is raised."""
    results = await asyncio.gather(*(_load(i, item, fetcher) for i, item in enumerate(items)),
                                   return_exceptions=True)
    for result in results:
        if isinstance(result, EncoderError):
            raise result
        if isinstance(result, BaseException):
            raise result
    return list(results)
