"""Client of the encoder-service vision encoder (gRPC). Needs grpcio, protobuf, numpy and ml_dtypes; no torch.

Usage::

    import numpy as np
    from encoder_client import EncoderClient, HashRef, EncoderClientError

    with EncoderClient("encoder:50051", timeout_s=30, retries=3) as client:
        info = client.model_info()                  # ModelInfo: hidden_size, dtype, cache_namespace...
        images = [
            open("cat.jpg", "rb").read(),           # encoded image bytes
            "dog.png",                              # a path: the client reads the file
            (patches, (1, 36, 36)),                 # preprocessed patches [t*h*w, patch_dim] + grid
        ]
        results = client.encode(images, output_dtype="bfloat16")   # request order, always
        for r in results:
            print(r.index, r.embedding.shape, r.content_hash[:12], r.cache_hit, r.latency_ms)
            # r.deepstack: the extra feature levels of models that have them (Qwen3-VL), else ()
        # A cached embedding can be fetched again by its hash, without resending pixels:
        again = client.encode([HashRef(results[0].content_hash)])
        print(client.lookup([r.content_hash for r in results]))   # [True, True, True]
        print(client.health())                                     # "SERVING"

    # asyncio:
    async with AsyncEncoderClient("encoder:50051") as client:
        results = await client.encode([b"..."])

Every failed RPC raises ``EncoderClientError`` with ``.code`` (grpc.StatusCode) and ``.details``
(the server's message, verbatim); bad arguments raise ValueError/TypeError before anything is sent.
Calls are retried on UNAVAILABLE only, with exponential backoff and jitter, and an Encode stream
only if none of its response had arrived: gRPC's own retry policy, which the client sets in its
channel's service config (``retries`` at most 4: gRPC's limit of 5 attempts).

What ``r.embedding`` is, by the wire dtype the server sent (``r.dtype``): float32 and float16 as
themselves; bf16 as a numpy array of dtype ``ml_dtypes.bfloat16`` (the JAX team's numpy extension
types), a view of the bytes received, so no conversion and no copy beyond the one out of the gRPC
message: numpy has no bfloat16 of its own, and widening to float32 would double the bytes and, for
a 9 MB embedding, cost milliseconds a cache hit does not otherwise take. It is exact, numpy's ufuncs
take it, and ``r.embedding.astype(np.float32)`` widens it exactly when floats are wanted.
``bf16_as="float32"`` has the client widen it (the former default), ``bf16_as="uint16"``
hands over the raw bit patterns (for code that passes the bytes on, e.g. to torch as
``torch.from_numpy(bits).view(torch.bfloat16)``).

``content_hash(image, namespace)`` computes the server's cache key locally, for ``lookup`` before
sending pixels.

EPD: ``client.encode(images, hash_first=True)`` sends pixels only for images the server does not
cache; ``client.encode_to_sink(images, "decode-0:9000", sink_request_id="r1")`` has the encoder push
the embeddings to a decode server, which receives them with ``EmbeddingSinkReceiver``
(``encoder_client.sink``); ``RoutingEncoderClient(["enc-0:50051", ...] or "dns:///enc:50051")``
spreads images over several encoders by content hash (``encoder_client.routing``).

Security: ``EncoderClient(target, credentials=tls_credentials(ca="ca.crt", cert="me.crt",
key="me.key"), token="...")`` speaks TLS (mutual TLS with cert/key) and sends ``authorization:
Bearer <token>`` with every call; the async and routing clients take the same two arguments.

Command line: ``encoder-client encode --target HOST:PORT FILE...``, ``encoder-client info``,
``encoder-client lookup``, ``encoder-client health`` (see ``encoder-client --help``);
``encoder-client proxy``, the OpenAI-compatible EPD front before vLLM (the ``proxy`` extra).
"""

from encoder_client._request import content_hash
from encoder_client.aio import AsyncEncoderClient
from encoder_client.client import EncoderClient
from encoder_client.errors import EncoderClientError
from encoder_client.protocol import ModelInfo, bf16_bits_to_float32
from encoder_client.routing import RoutingEncoderClient
from encoder_client.security import read_token_file, tls_credentials
from encoder_client.sink import EmbeddingSinkReceiver, PushedImage
from encoder_client.types import EncodedImage, HashRef, ImageInput, Video

__all__ = [
    "AsyncEncoderClient",
    "EmbeddingSinkReceiver",
    "EncodedImage",
    "EncoderClient",
    "EncoderClientError",
    "HashRef",
    "ImageInput",
    "ModelInfo",
    "PushedImage",
    "RoutingEncoderClient",
    "Video",
    "bf16_bits_to_float32",
    "content_hash",
    "read_token_file",
    "tls_credentials",
]
