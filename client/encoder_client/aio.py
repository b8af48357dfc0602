"""The asyncio client (grpc.aio); same behaviour and arguments as EncoderClient."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2

from encoder_client._reassembly import check_lookup_response, reassembling
from encoder_client._request import build_request, check_images_sequence
from encoder_client._rpc import ClientBase, address_to_sink, check_bf16_as, health_status_name, lookup_request
from encoder_client.dtypes import DEFAULT_BF16_AS
from encoder_client.errors import EncoderClientError
from encoder_client.hash_first import HashFirstPlan, is_eviction_race
from encoder_client.protocol import ModelInfo, encoder_pb2
from encoder_client.shared_memory import OutputRegion, RegionPool, SealedRegion
from encoder_client.sink import PushedImage, collect_headers
from encoder_client.types import EncodedImage, ImageInput

_Resp = TypeVar("_Resp")


async def _acquired(regions: RegionPool) -> OutputRegion | SealedRegion:
    """A region of ``regions`` for one call; a new one is made off the event loop (a registered one
    waits for the server's answer, and a loop blocked on it stalls every other call of this client)."""
    region = regions.acquire(create=False)
    if region is not None:
        return region
    made = asyncio.get_running_loop().run_in_executor(None, regions.acquire)
    try:
        return await asyncio.shield(made)
    except asyncio.CancelledError:
        # Cancelled while it was being made: back to the pool once it exists.
        made.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None
                               else regions.release(f.result(), needed_bytes=f.result().size, failed=False))
        raise


class AsyncEncoderClient(ClientBase):
    """asyncio client of the VisionEncoder service; see EncoderClient for the arguments.

    Create it inside a running event loop and use it from that loop (grpc.aio channels belong to
    one loop); ``async with AsyncEncoderClient(...) as client:`` closes the channel.
    """

    _channels = grpc.aio

    async def __aenter__(self) -> AsyncEncoderClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        if self._regions is not None:
            self._regions.close()

    async def encode(
        self,
        images: Sequence[ImageInput],
        *,
        output_dtype: str | None = None,
        max_chunk_bytes: int | None = None,
        timeout_s: float | None = None,
        bf16_as: str = DEFAULT_BF16_AS,
        request_id: str | None = None,
        hash_first: bool = False,
    ) -> list[EncodedImage]:
        """Encode images; one EncodedImage per image, in request order (see EncoderClient.encode)."""
        kwargs = {"output_dtype": output_dtype, "max_chunk_bytes": max_chunk_bytes, "timeout_s": timeout_s,
                  "bf16_as": bf16_as, "request_id": request_id}
        if not hash_first:
            return await self._encode(images, **kwargs)
        namespace = await self.cache_namespace()
        plan = await asyncio.to_thread(HashFirstPlan.build, images, namespace)  # reads files, hashes
        cached = await self.lookup(plan.lookup_hashes, timeout_s=timeout_s) if plan.lookup_indices else []
        send, replaced = plan.to_send(cached)
        try:
            return await self._encode(send, **kwargs)
        except EncoderClientError as err:
            if not is_eviction_race(err, replaced):
                raise
            return await self._encode(plan.images, **kwargs)  # evicted since Lookup: send the pixels

    async def encode_to_sink(
        self,
        images: Sequence[ImageInput],
        sink_target: str,
        *,
        sink_request_id: str | None = None,
        output_dtype: str | None = None,
        max_chunk_bytes: int | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> list[PushedImage]:
        """See EncoderClient.encode_to_sink: the server pushes the embeddings to sink_target."""
        request = await asyncio.to_thread(build_request, images, output_dtype=output_dtype,
                                          max_chunk_bytes=max_chunk_bytes, request_id=request_id)
        address_to_sink(request, sink_target, sink_request_id)
        if not request.images:
            return []
        chunks: list[encoder_pb2.EmbeddingChunk] = []
        await self._call_encode(request, timeout_s, chunks.append)
        return collect_headers(chunks, len(request.images))

    async def cache_namespace(self) -> str:
        """The server's cache_namespace (asked once: it is fixed for a server's life)."""
        if self._cache_namespace is None:
            self._cache_namespace = (await self.model_info()).cache_namespace
        return self._cache_namespace

    async def _encode(
        self,
        images: Sequence[ImageInput],
        *,
        timeout_s: float | None,
        bf16_as: str,
        **request_kwargs: Any,  # build_request's: output_dtype, max_chunk_bytes, request_id
    ) -> list[EncodedImage]:
        check_bf16_as(bf16_as)
        check_images_sequence(images)
        if any(isinstance(image, (str, os.PathLike)) for image in images):
            # Reading files would block the event loop.
            request = await asyncio.to_thread(build_request, images, **request_kwargs)
        else:
            request = build_request(images, **request_kwargs)
        if not request.images:
            return []
        if not self._socket_asked:
            await self._ask_region_socket(timeout_s)
        # gRPC retries an attempt that failed UNAVAILABLE before any response arrived (see
        # RetryPolicy); this call's iteration sees only the attempt that answered.
        try:
            regions = self._regions
            region = await _acquired(regions) if regions is not None else None
            with reassembling(request, bf16_as=bf16_as, regions=regions, region=region) as reassembler:
                await self._call_encode(request, timeout_s, reassembler.add)
                return reassembler.results()
        except (EncoderClientError, OSError) as err:
            if not self._stream_from_now_on(err, lent_registered=bool(request.output_region.handle)):
                raise
        request.ClearField("output_region")
        with reassembling(request, bf16_as=bf16_as, regions=None) as reassembler:
            await self._call_encode(request, timeout_s, reassembler.add)
            return reassembler.results()

    async def _ask_region_socket(self, timeout_s: float | None) -> None:
        # On the loop alone: two calls may both ask before either has its answer; the second's is
        # ignored (_use_region_socket marks it asked). New regions are then registered off the loop
        # (_acquired).
        try:
            info = await self.model_info(timeout_s=timeout_s)
        except EncoderClientError as err:
            if err.code.name in self._ASK_AGAIN:
                return
            info = None
        if not self._socket_asked:
            self._use_region_socket(info)

    async def _call_encode(self, request: encoder_pb2.EncodeRequest, timeout_s: float | None,
                           on_chunk: Callable[[encoder_pb2.EmbeddingChunk], object]) -> None:
        """One Encode stream, each chunk given to on_chunk (retried by gRPC on UNAVAILABLE while
        nothing of it has arrived)."""
        call = self._encode_rpc(request, timeout=self._timeout(timeout_s), metadata=self._metadata)
        try:
            async for chunk in call:
                on_chunk(chunk)
        except grpc.RpcError as err:
            raise EncoderClientError.from_rpc_error(err) from err
        except BaseException:
            call.cancel()  # includes asyncio cancellation: stop the server's work too
            raise

    async def lookup(self, content_hashes: Sequence[str], *, timeout_s: float | None = None) -> list[bool]:
        """Which of content_hashes the server caches now (a hint: entries may be evicted later)."""
        request = lookup_request(content_hashes)
        response = await self._unary(self._stub.Lookup, request, timeout_s)
        return check_lookup_response(request, response)

    async def model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        """What the server runs, including the cache_namespace for computing content hashes."""
        msg = await self._unary(self._stub.GetModelInfo, encoder_pb2.GetModelInfoRequest(), timeout_s)
        return ModelInfo.from_proto(msg)

    async def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """grpc.health.v1 Check status name; see EncoderClient.health."""
        response = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout_s)
        return health_status_name(response)

    async def _unary(self, method: Callable[..., Awaitable[_Resp]], request: Any,
                     timeout_s: float | None) -> _Resp:
        try:
            return await method(request, timeout=self._timeout(timeout_s), metadata=self._metadata)
        except grpc.RpcError as err:
            raise EncoderClientError.from_rpc_error(err) from err
