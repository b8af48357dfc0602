"""Kept for existing imports: the content hash is part of the protocol, ``encoder_client.protocol.hashing``."""

from encoder_client.protocol.hashing import HASH_VERSION, KIND_ENCODED, KIND_PATCHES, hash_encoded, hash_patches

__all__ = ["HASH_VERSION", "KIND_ENCODED", "KIND_PATCHES", "hash_encoded", "hash_patches"]
