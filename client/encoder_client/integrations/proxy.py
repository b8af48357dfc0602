"""``encoder-client proxy``: an OpenAI-compatible HTTP front to put before vLLM (EPD).

For each image (``image_url`` part) and clip (``video_url`` part) of a ``/v1/chat/completions``
request it has the encoder service encode it (hash-first: pixels go only to an encoder that does not
cache it already). A clip goes as ``Video(data, reference="vllm", fps=--video-fps)``, sampled as vLLM
samples it, or, given as vLLM's ``data:video/jpeg;base64,<frame>,...``, as ``Video(frames=...,
reference="vllm")``: every frame, as vLLM takes them. It rewrites the part with ``"uuid": <content
hash>`` and forwards the request to vLLM, whose ``EncoderServiceECConnector``
(``encoder_client.integrations.vllm``) then takes the embedding from the encoder by that key instead
of running its own vision tower. vLLM's answer (SSE or JSON) and status code come back unchanged;
every other path (``/v1/models``, ``/health``, ...) is passed through. Needs aiohttp (the client's
``proxy`` extra); the rewriting itself is ``encoder_client.integrations.proxy_rewrite``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import grpc
from aiohttp import web

from encoder_client._request import content_hash
from encoder_client.cache_only import encode_cache_only
from encoder_client.client import EncoderClient
from encoder_client.errors import EncoderClientError
from encoder_client.integrations.proxy_rewrite import (
    CONTENT_HASH_RE,
    HostAllowList,
    MediaPart,
    ProxyRequestError,
    apply_mm_kwargs_policy,
    bad_request,
    decode_data_url,
    decode_frames_data_url,
    is_data_url,
    is_frames_data_url,
    media_parts,
    rewrite_part,
    to_data_url,
)
from encoder_client.routing import RoutingEncoderClient
from encoder_client.types import ImageInput, Video

log = logging.getLogger("encoder_client.proxy")

# Hop-by-hop headers, and those aiohttp recomputes for the body it sends.
_NOT_FORWARDED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                            "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"})


@dataclass
class ProxySettings:
    encoder: list[str]                      # host:port targets, or one dns:///name:port
    vllm: str                               # base URL of the vLLM prefill/decode server
    allowed_hosts: list[str] = field(default_factory=list)
    mm_kwargs: str = "refuse"               # or "strip"
    max_image_bytes: int = 32 << 20
    max_video_bytes: int = 64 << 20         # the encoder's own --max-video-bytes default
    # The fps vLLM samples clips at: its default, 2, with the connector (its --media-io-kwargs would
    # change it, but vLLM hashes every uuid with them). A clip's uuid is its content hash sampled so,
    # which must be what vLLM counts placeholders for.
    video_fps: float = 2.0
    max_request_bytes: int = 128 << 20
    encoder_timeout_s: float = 60.0
    # "cache": the encoder encodes and caches each miss and returns its header only (Encode
    # cache_only); "full": it streams the embedding back, which the proxy drops (servers older
    # than cache_only do that anyway).
    encode_mode: str = "cache"
    fetch_timeout_s: float = 10.0
    security: dict[str, Any] = field(default_factory=dict)  # credentials / token of the encoder clients


class EncoderBridge:
    """The blocking encoder calls of one request, run in a worker thread."""

    def __init__(self, targets: Sequence[str], timeout_s: float, security: dict[str, Any],
                 cache_only: bool = True) -> None:
        self.cache_only = cache_only
        self.single = len(targets) == 1 and not targets[0].startswith("dns:")
        self.client: EncoderClient | RoutingEncoderClient = (
            EncoderClient(targets[0], timeout_s=timeout_s, **security) if self.single
            else RoutingEncoderClient(list(targets), timeout_s=timeout_s, **security))

    def close(self) -> None:
        self.client.close()

    def cached(self, content_hashes: Sequence[str]) -> list[bool]:
        """Whether the encoder each hash routes to caches it now."""
        if self.single:
            return self.client.lookup(list(content_hashes))
        client = self.client
        assert isinstance(client, RoutingEncoderClient)
        out = []
        for h in content_hashes:
            target = client.route(h)
            if target is None:
                raise EncoderClientError(grpc.StatusCode.UNAVAILABLE, "no encoder is healthy")
            out.extend(client._client(target).lookup([h]))
        return out

    def ensure_encoded(self, images: Sequence[ImageInput]) -> list[str]:
        """Each image's (or clip's: a ``Video``) content hash, once the encoder caches its embedding."""
        namespace = self.client.cache_namespace()
        hashes = [content_hash(image, namespace) for image in images]
        unique = {h: image for h, image in zip(hashes, images, strict=True)}
        todo = list(unique)
        if self.single:  # skip what the encoder caches already (the routing client asks each encoder)
            todo = [h for h, hit in zip(todo, self.client.lookup(todo), strict=True) if not hit]
        if todo:
            images_todo = [unique[h] for h in todo]
            if self.cache_only and self.single:  # pixels of misses only: Lookup said they are not cached
                results: Sequence[Any] = encode_cache_only(self.client, images_todo, hash_first=False)
            elif self.cache_only:
                results = self.client.encode(images_todo, cache_only=True)
            else:
                results = self.client.encode(images_todo, **({"hash_first": True} if self.single else {}))
            for want, got in zip(todo, results, strict=True):
                if got.content_hash != want:  # a server hashing otherwise would break the uuid contract
                    raise EncoderClientError(grpc.StatusCode.INTERNAL, f"encoder returned content hash "
                                             f"{got.content_hash} for an image hashed {want} here")
        return hashes


def _error(err: ProxyRequestError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


def _encoder_error(err: EncoderClientError, parts: Sequence[MediaPart]) -> ProxyRequestError:
    # images[k]: the k-th item of the Encode request (clips travel there too), as the encoder names it.
    names = ", ".join(f"images[{k}] = {p.where}" for k, p in enumerate(parts))
    nouns = {p.noun for p in parts}
    an_item = "an image" if nouns == {"image"} else "a clip" if nouns == {"clip"} else "an image or clip"
    if err.retry_may_pass:  # down, too slow, or a full queue: the same request may pass later
        headers = {}
        if err.retry_pushback_ms is not None and err.retry_pushback_ms >= 0:
            headers["Retry-After"] = str(max(1, math.ceil(err.retry_pushback_ms / 1000)))
        return ProxyRequestError(503, f"encoder service unavailable ({err.code.name}: {err.details})",
                                 headers=headers)
    if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # an image over the encoder's limits: final
        return ProxyRequestError(413, f"the encoder refused {an_item} of this request as over its limits "
                                      f"({err.details}); {names}")
    if err.code == grpc.StatusCode.INVALID_ARGUMENT:
        return bad_request(f"the encoder refused {an_item} of this request ({err.details}); {names}")
    return ProxyRequestError(502, f"encoder service failed ({err.code.name}: {err.details})")


class EpdProxy:
    def __init__(self, settings: ProxySettings) -> None:
        if not settings.video_fps > 0:
            raise ValueError(f"--video-fps must be > 0, got {settings.video_fps!r}")
        self.settings = settings
        self.vllm = settings.vllm.rstrip("/")
        self.allowed = HostAllowList(settings.allowed_hosts)
        self.bridge = EncoderBridge(settings.encoder, settings.encoder_timeout_s, settings.security,
                                    cache_only=settings.encode_mode == "cache")
        self.session: aiohttp.ClientSession | None = None
        self.fetcher: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_request_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_route("*", "/{tail:.*}", self.passthrough)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        # Bytes go through verbatim (no decompression); a stream may take as long as vLLM needs.
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=10))
        self.fetcher = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.settings.fetch_timeout_s))

    async def _close(self, _app: web.Application) -> None:
        for session in (self.session, self.fetcher):
            if session is not None:
                await session.close()
        await asyncio.to_thread(self.bridge.close)

    # --- handlers --------------------------------------------------------------------------------
    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, await request.read())

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._rewritten(request)
        except ProxyRequestError as err:
            log.info("%s %s: %d %s", request.method, request.path, err.status, err.message)
            return _error(err)
        return await self._forward(request, json.dumps(body).encode())

    async def _rewritten(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except web.HTTPRequestEntityTooLarge:
            raise ProxyRequestError(413, f"request larger than --max-request-bytes "
                                         f"({self.settings.max_request_bytes} bytes)") from None
        except (ValueError, UnicodeDecodeError) as err:
            raise bad_request(f"request body is not JSON ({err})") from None
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        stripped = apply_mm_kwargs_policy(body, self.settings.mm_kwargs)
        if stripped:
            log.info("stripped %s from a request (--mm-kwargs strip)", ", ".join(stripped))
        parts = media_parts(body)
        await self._check_references([p for p in parts if p.uuid is not None])
        parts = [p for p in parts if p.uuid is None]
        if not parts:
            return body
        media = await asyncio.gather(*(self._media(p) for p in parts))
        # A clip is sampled as vLLM samples it (its loader, at vLLM's fps): its content hash, the
        # uuid, then names the embedding of the very frames vLLM counts placeholders for.
        items: list[ImageInput] = [
            (Video(frames=raw, reference="vllm") if isinstance(raw, list)
             else Video(raw, reference="vllm", fps=self.settings.video_fps)) if p.is_video else raw
            for p, (_, raw) in zip(parts, media, strict=True)]
        try:
            hashes = await asyncio.to_thread(self.bridge.ensure_encoded, items)
        except EncoderClientError as err:
            raise _encoder_error(err, parts) from None
        except (ValueError, TypeError) as err:  # the client refused an image before sending it
            raise bad_request(f"an image of this request cannot be sent to the encoder ({err})") from None
        for part, (url, _), uuid in zip(parts, media, hashes, strict=True):
            # The pixels stay: vLLM 0.33.0 takes a uuid alone only as a hit of its own processor
            # cache (it needs the image, or the clip, for the prompt's placeholder count), never on
            # a first sight.
            rewrite_part(part, uuid, url)
        return body

    async def _check_references(self, refs: Sequence[MediaPart]) -> None:
        """Parts that name their image by uuid alone go to vLLM as they are, once the encoder is
        seen to cache each uuid: otherwise vLLM's connector would fail the request with an HTTP
        500 whose reason is only in vLLM's log; here it is a 400 naming the part, before vLLM."""
        if not refs:
            return
        for ref in refs:
            if not CONTENT_HASH_RE.match(ref.uuid or ""):
                what = "a video_url part without a clip" if ref.is_video else "an image part without an image"
                raise bad_request(f"{ref.where}: {what} must carry the encoder's content "
                                  f"hash of it as its uuid (64 hex digits), got {ref.uuid[:80]!r}", ref.where)
        try:
            cached = await asyncio.to_thread(self.bridge.cached, [r.uuid for r in refs])
        except EncoderClientError as err:
            raise _encoder_error(err, refs) from None
        missing = [r for r, hit in zip(refs, cached, strict=True) if not hit]
        if missing:
            raise bad_request(
                "; ".join(f"{r.where}: the encoder does not cache the {r.noun} of uuid {r.uuid} (never encoded, or "
                          "evicted)" for r in missing)
                + f": send the {missing[0].noun} itself (a data: URL) in that part", missing[0].where)

    def _limit(self, part: MediaPart) -> tuple[int, str]:
        """The part's byte limit and the flag that sets it."""
        if part.is_video:
            return self.settings.max_video_bytes, "--max-video-bytes"
        return self.settings.max_image_bytes, "--max-image-bytes"

    async def _media(self, part: MediaPart) -> tuple[str, bytes | list[bytes]]:
        """(the data URL to forward, the image's or clip's bytes; a clip's frames for vLLM's video/jpeg)."""
        if part.is_video and is_frames_data_url(part.url):
            limit, flag = self._limit(part)
            return part.url, decode_frames_data_url(part.url, part.where, limit, flag)
        if is_data_url(part.url):
            limit, flag = self._limit(part)
            _, raw = decode_data_url(part.url, part.where, limit, part.noun, flag)
            return part.url, raw
        scheme, host = (urlsplit(part.url).scheme.lower(), urlsplit(part.url).hostname or "")
        label = "video" if part.is_video else "image"
        if scheme not in ("http", "https"):
            raise bad_request(f"{part.where}: {label} URL scheme {scheme or '(none)'!r} not supported: "
                              f"send a data: URL (or http(s) from an allowed host)", part.where)
        if not self.allowed.allows(host):
            hint = (f"allowed: {', '.join(self.allowed.patterns)}" if self.allowed
                    else "the proxy fetches no URL unless started with --allowed-hosts")
            raise bad_request(f"{part.where}: {label} URL host {host!r} not allowed ({hint}); "
                              f"send the {part.noun} as a data: URL", part.where)
        return await self._fetch(part, host)

    async def _fetch(self, part: MediaPart, host: str) -> tuple[str, bytes]:
        assert self.fetcher is not None
        limit, flag = self._limit(part)
        try:
            async with self.fetcher.get(part.url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise bad_request(f"{part.where}: fetching the {part.noun} from {host} answered HTTP "
                                      f"{resp.status}", part.where)
                raw = await resp.content.read(limit + 1)
                mime = resp.content_type or "application/octet-stream"
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise bad_request(f"{part.where}: fetching the {part.noun} from {host} failed "
                              f"({type(err).__name__}: {err})", part.where) from None
        if len(raw) > limit:
            raise ProxyRequestError(413, f"{part.where}: {part.noun} larger than {flag} ({limit} bytes)")
        # vLLM gets the very bytes that were hashed and encoded, not a second fetch of the URL.
        return to_data_url(mime, raw), raw

    async def _forward(self, request: web.Request, body: bytes) -> web.StreamResponse:
        assert self.session is not None
        url = self.vllm + request.rel_url.path_qs
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        try:
            upstream = await self.session.request(request.method, url, headers=headers, data=body,
                                                  allow_redirects=False)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            return _error(ProxyRequestError(502, f"vLLM at {self.vllm} unreachable ({type(err).__name__}: {err})"))
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _NOT_FORWARDED:
                    response.headers.add(key, value)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            # Each chunk as it arrives: an SSE stream comes back event by event.
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def settings_from_args(args: argparse.Namespace, security: dict[str, Any]) -> ProxySettings:
    return ProxySettings(
        encoder=[t.strip() for t in args.encoder.split(",") if t.strip()], vllm=args.vllm,
        allowed_hosts=[h for h in (args.allowed_hosts or "").split(",") if h.strip()], mm_kwargs=args.mm_kwargs,
        max_image_bytes=args.max_image_bytes, max_request_bytes=args.max_request_bytes,
        max_video_bytes=getattr(args, "max_video_bytes", 64 << 20), video_fps=getattr(args, "video_fps", 2.0),
        encoder_timeout_s=args.timeout, fetch_timeout_s=args.fetch_timeout, security=security,
        encode_mode=getattr(args, "encode_mode", "cache"))


def run(args: argparse.Namespace, security: dict[str, Any]) -> int:
    """The ``encoder-client proxy`` command: serve until SIGINT/SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = settings_from_args(args, security)
    proxy = EpdProxy(settings)
    print(f"encoder-client proxy: http://{args.host}:{args.port} -> vLLM {settings.vllm}, "
          f"encoder {', '.join(settings.encoder)}", flush=True)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0
