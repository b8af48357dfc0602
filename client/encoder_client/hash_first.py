"""Hash-first encoding: send pixels only for images the server does not cache already.

The client computes each image's content hash exactly as the server does (``encoder_client.hashing``
with the server's ``cache_namespace`` from GetModelInfo), asks ``Lookup``, and sends a ``HashRef``
for every hit and the pixels for every miss. ``Lookup`` is a hint: an entry can be evicted between
it and the Encode, which then fails NOT_FOUND before any chunk is sent; the request is then sent
again with every image's pixels, so the caller never sees the race.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from encoder_client._request import check_images_sequence, content_hash, image_to_proto
from encoder_client.errors import EncoderClientError
from encoder_client.protocol import encoder_pb2
from encoder_client.types import HashRef, ImageInput


@dataclass
class HashFirstPlan:
    """The images as protos (files read once), their hashes, and what to send after Lookup."""

    images: list[encoder_pb2.Image]
    hashes: list[str]
    lookup_indices: list[int]  # images whose cached state is worth asking (not already a HashRef)

    @classmethod
    def build(cls, images: Sequence[ImageInput], cache_namespace: str) -> HashFirstPlan:
        check_images_sequence(images)
        protos = [image_to_proto(i, image) for i, image in enumerate(images)]
        hashes = [content_hash(p, cache_namespace) for p in protos]
        lookup = [i for i, p in enumerate(protos) if p.WhichOneof("source") != "content_hash"]
        return cls(protos, hashes, lookup)

    @property
    def lookup_hashes(self) -> list[str]:
        return [self.hashes[i] for i in self.lookup_indices]

    def to_send(self, cached: Sequence[bool]) -> tuple[list[ImageInput], bool]:
        """The images with cached ones replaced by HashRef; and whether any was replaced."""
        send: list[ImageInput] = list(self.images)
        for i, hit in zip(self.lookup_indices, cached, strict=True):
            if hit:
                send[i] = HashRef(self.hashes[i])
        return send, any(cached)


def is_eviction_race(err: EncoderClientError, replaced_any: bool) -> bool:
    """NOT_FOUND after we referenced images by hash: resend them with their pixels."""
    return replaced_any and err.code == grpc.StatusCode.NOT_FOUND
