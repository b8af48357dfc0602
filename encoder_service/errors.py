"""Typed errors raised anywhere below the API layer.

Each carries the gRPC status name it maps to; the API layer turns them into statuses in one place
(the server interceptor of ``encoder_service.api.service_interceptor``). Layers below the API never import grpc.
"""

from __future__ import annotations

import copy

# gRPC's status codes by name, in ``grpc.StatusCode``'s order: the values ``EncoderError.code`` takes
# and the ``code`` label of encoder_service_requests_total (metrics.py). Spelled out so that nothing
# below the API imports grpc; api/error_status.py maps a name to its ``grpc.StatusCode``, and
# tests/test_architecture.py checks this list against grpc's.
STATUS_CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
                "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")


class EncoderError(Exception):
    """Base of every error the service reports to a caller."""

    code = "INTERNAL"

    def __init__(self, message: str, *, image_index: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.image_index = image_index

    def with_image(self, image_index: int) -> EncoderError:
        """The same error, tagged with the index of the image in the caller's request."""
        if self.image_index is None:
            self.image_index = image_index
        return self

    def for_image(self, image_index: int) -> EncoderError:
        """A copy naming ``image_index``, of the same type with every attribute (a retry hint
        included); the original is left as it is. For an error shared by several requests (a job's):
        each gets a copy naming its own image. The copy holds no traceback, context or cause: it is
        raised afresh, and must not keep the frames (and what their locals hold) of the original."""
        clone = copy.copy(self)
        clone.image_index = image_index
        clone.__traceback__ = clone.__context__ = clone.__cause__ = None
        return clone

    def __copy__(self) -> EncoderError:
        # Not through __init__ (what copy.copy of an exception does by default, from ``args``): a
        # subclass's constructor may take other arguments (SinkFailed's reason and detail).
        clone = type(self).__new__(type(self), *self.args)
        clone.__dict__.update(self.__dict__)
        return clone

    def __str__(self) -> str:
        if self.image_index is None:
            return self.message
        return f"image {self.image_index}: {self.message}"


class InvalidInput(EncoderError, ValueError):
    """Malformed input: bad grid, bad patches, bad image bytes, bad option."""

    code = "INVALID_ARGUMENT"


class DecoderUnusable(InvalidInput):
    """A clip's decode failed and left its decoder process unable to decode another (NVDEC: the process's
    CUDA context no longer runs work, after a sticky CUDA error or an Xid). The caller gets the clip's
    error; the process leaves and the pool starts a fresh one, instead of one that refuses every clip.
    INVALID_ARGUMENT, which clients do not retry: the clip most likely broke the context (a retry would
    break another process), and a fault of the whole GPU fails the server's own forward too."""


class NotFound(EncoderError, KeyError):
    """A referenced content hash is not cached."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return EncoderError.__str__(self)


class ResourceExhausted(EncoderError):
    """Over a configured limit: message size, image size, batch tokens, queue depth.

    ``retry_after_s`` tells the two kinds apart, and reaches the caller as gRPC's retry pushback
    (``grpc-retry-pushback-ms``, gRFC A6): set for a momentary limit (a full queue, a client's
    calls in progress), which the same request may pass a little later or on another replica;
    None for a request that is itself over a limit (an image with too many patches or pixels),
    which no retry can pass (pushback -1: "do not retry").
    """

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, image_index: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message, image_index=image_index)
        self.retry_after_s = retry_after_s


# A full queue or a client's limit frees up within about a batch's forward on a GPU (0.1-0.5 s):
# the pushback a momentary refusal asks for.
RETRY_AFTER_S = 1.0


class Unauthenticated(EncoderError):
    """A call without the credentials the server requires (a bearer token)."""

    code = "UNAUTHENTICATED"


class PermissionDenied(EncoderError):
    code = "PERMISSION_DENIED"


class Unavailable(EncoderError):
    """Starting, draining, or a dependency (a sink) is down."""

    code = "UNAVAILABLE"


class BackendUnavailable(EncoderError, RuntimeError):
    """A configured attention backend cannot run here (missing library, wrong device, dtype, head_dim).

    Raised at load time, never during a request.
    """

    code = "FAILED_PRECONDITION"


class DecodeTimeout(ResourceExhausted):
    """A decode (an image's, a clip's decode and resize) that ran past its time bound. A type of its
    own so that code tells a timeout from other limits without reading the message."""


class Cancelled(EncoderError):
    """The work was stopped because nobody waits for it any more (its request was cancelled or its
    deadline passed)."""

    code = "CANCELLED"
