"""What the server interceptors share: refusing a call before it reaches its handler, and wrapping
a handler's behaviour, whatever its cardinality. A refusal raises a typed error; the service
interceptor (api/service_interceptor.py), outermost, turns it into a status and counts it like any answer."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import grpc
from google.protobuf.descriptor import MethodDescriptor

from ..errors import EncoderError

log = logging.getLogger(__name__)

# Callers must reach these without credentials: Kubernetes probes, grpcurl listing the services.
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                         "/grpc.reflection.v1.ServerReflection/")

# Metadata a relay process (api/relay/process.py) sets on each call it passes on: the caller's own peer
# (gRPC's peer string), which per-client limits count by. Whatever a caller sent under this key is
# dropped by the relay.
RELAYED_PEER = "x-encoder-relayed-peer"

_KINDS = (("unary_unary", grpc.unary_unary_rpc_method_handler),
          ("unary_stream", grpc.unary_stream_rpc_method_handler),
          ("stream_unary", grpc.stream_unary_rpc_method_handler),
          ("stream_stream", grpc.stream_stream_rpc_method_handler))


def metadata_value(details: grpc.HandlerCallDetails, key: str) -> str | None:
    for item in details.invocation_metadata or ():
        k, v = item[0], item[1]  # plain tuples or grpc.aio's Metadatum
        if k == key:
            return v if isinstance(v, str) else None  # a binary (-bin) value is no text header
    return None


def method_path(method: MethodDescriptor) -> str:
    """``/encoder.v1.VisionEncoder/Encode``: how gRPC names a method of the descriptor in a call."""
    return f"/{method.containing_service.full_name}/{method.name}"


def refusal(handler: grpc.RpcMethodHandler, error: EncoderError) -> grpc.RpcMethodHandler:
    """A handler of handler's kind that raises ``error`` without reading the request: the payload
    is not even deserialized."""

    async def refuse_call(request, context: grpc.aio.ServicerContext):
        raise error

    for kind, factory in _KINDS:
        if getattr(handler, kind) is not None:
            return factory(refuse_call)
    raise TypeError("unknown kind of method handler")


def wrap_behaviour(handler: grpc.RpcMethodHandler,
                   guard: Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager]) -> grpc.RpcMethodHandler:
    """handler with its behaviour run inside ``async with guard(context)``: the guard's exit runs
    however the call ends (its task cancelled included). Coroutine behaviours (streams written
    through ``context.write``, as the servicers here do) and async-generator ones are both wrapped."""
    for kind, factory in _KINDS:
        behaviour = getattr(handler, kind)
        if behaviour is None:
            continue
        if inspect.isasyncgenfunction(behaviour):
            async def wrapped(request, context, behaviour=behaviour):
                async with guard(context):
                    async for response in behaviour(request, context):
                        yield response
        else:
            async def wrapped(request, context, behaviour=behaviour):
                async with guard(context):
                    return await behaviour(request, context)

        return factory(functools.wraps(behaviour)(wrapped), request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
    raise TypeError("unknown kind of method handler")
