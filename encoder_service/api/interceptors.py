"""What the server interceptors share: refusing a call before it reaches its handler, and wrapping
a handler's behaviour, whatever its cardinality."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import grpc

from .. import metrics

log = logging.getLogger(__name__)

# Callers must reach these without credentials: Kubernetes probes, grpcurl listing the services.
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                         "/grpc.reflection.v1.ServerReflection/")

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


def method_name(details: grpc.HandlerCallDetails) -> str:
    """``Encode`` of ``/encoder.v1.VisionEncoder/Encode``: the label the request metrics use."""
    return details.method.rsplit("/", 1)[-1]


async def refuse(context: grpc.aio.ServicerContext, method: str, code: grpc.StatusCode, message: str) -> None:
    """Ends the call with code/message, counted in the request metrics like the servicer's answers
    (a refused call never reaches ``map_errors``)."""
    metrics.REQUESTS.labels(method, code.name).inc()
    await context.abort(code, message)


def refusal(handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode,
            message: str) -> grpc.RpcMethodHandler:
    """A handler of handler's kind that answers code/message without reading the request: the
    payload is not even deserialized."""

    async def refuse_call(request, context: grpc.aio.ServicerContext):
        await refuse(context, method, code, message)

    for kind, factory in _KINDS:
        if getattr(handler, kind) is not None:
            return factory(refuse_call)
    raise TypeError(f"unknown kind of method handler for {method}")


def wrap_behaviour(handler: grpc.RpcMethodHandler,
                   around: Callable[[Callable, object, grpc.aio.ServicerContext], object]) -> grpc.RpcMethodHandler:
    """handler with its behaviour called through ``around(behaviour, request, context)``, an async
    function that awaits the behaviour's result. Only coroutine behaviours (what the servicers
    here are: streams write through ``context.write``) are supported: an async-generator one would
    need a generator wrapper, and there is none to wrap."""
    for kind, factory in _KINDS:
        behaviour = getattr(handler, kind)
        if behaviour is None:
            continue
        if inspect.isasyncgenfunction(behaviour):
            raise TypeError(f"{kind} handler {behaviour!r} is an async generator; wrap_behaviour needs a coroutine")

        @functools.wraps(behaviour)
        async def wrapped(request, context, behaviour=behaviour):
            return await around(behaviour, request, context)

        return factory(wrapped, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
    raise TypeError("unknown kind of method handler")
