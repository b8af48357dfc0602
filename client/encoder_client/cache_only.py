"""Encode and cache, return no rows: ``EncodeRequest.cache_only``.

For a caller that needs an image's embedding cached on the encoder, for a later reference by
content hash, and never reads the rows itself: the EPD proxy, whose vLLM connector fetches the
embedding by its hash. The server answers each image with its header chunk only (content hash,
token count, grid, cache hit), so nothing but a few hundred bytes comes back. Hash-first as
``EncoderClient.encode(hash_first=True)``: images the server caches go as content-hash references
(a header costs nothing more), pixels only for the others. A server older than the field ignores
it and streams the rows, which are read and dropped: the answer is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from encoder_client._request import build_request
from encoder_client.errors import EncoderClientError
from encoder_client.hash_first import HashFirstPlan, is_eviction_race
from encoder_client.sink import PushedImage, collect_headers
from encoder_client.types import ImageInput

if TYPE_CHECKING:
    from encoder_client.client import EncoderClient


def encode_cache_only(client: EncoderClient, images: Sequence[ImageInput], *, timeout_s: float | None = None,
                      hash_first: bool = True, request_id: str | None = None) -> list[PushedImage]:
    """Have the server encode and cache ``images``; each image's header, in request order."""
    send, replaced = list(images), False
    if hash_first and images:
        plan = HashFirstPlan.build(images, client.cache_namespace())
        cached = client.lookup(plan.lookup_hashes, timeout_s=timeout_s) if plan.lookup_indices else []
        send, replaced = plan.to_send(cached)
    try:
        return _call(client, send, timeout_s, request_id)
    except EncoderClientError as err:
        if not is_eviction_race(err, replaced):
            raise
        return _call(client, plan.images, timeout_s, request_id)  # evicted since Lookup: send the pixels


def _call(client: EncoderClient, images: Sequence[ImageInput], timeout_s: float | None,
          request_id: str | None) -> list[PushedImage]:
    request = build_request(images, output_dtype=None, max_chunk_bytes=None, request_id=request_id)
    if not request.images:
        return []
    request.cache_only = True
    chunks = client._call_encode(request, timeout_s, list)
    return collect_headers(chunks, len(request.images))
