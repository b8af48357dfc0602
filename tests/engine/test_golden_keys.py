"""Golden vectors of the cache keys: the content hash and the tiny presets' ``cache_namespace``.

DO NOT UPDATE THESE LITERALS TO MAKE A TEST PASS. Deployed clients compute the same content hash
locally (``encoder_client.protocol.hashing``, to ask ``Lookup`` before sending pixels) from the namespace the
server reports: a change to either format breaks every deployed client's keys (all its lookups
miss, and the server's cache is cold after an upgrade). A change here must be deliberate: bump
``HASH_VERSION`` (or the namespace's inputs) on purpose, say so in the release notes, and only then
write the new values in. The values were computed once from the code as it stood and are literals.
"""

from __future__ import annotations

import pytest
from encoder_client.protocol import DTYPES, encoder_pb2, hashing

from encoder_service.models import load_vision_model

QWEN_NAMESPACE = "qwen2_5_vl:c06ac5f244ace0bf2c8f6bf6"  # tiny-qwen2.5-vl, float32, pil (the CPU default)
PNG_LIKE = b"\x89PNG\r\n\x1a\n" + bytes(range(256))

ENCODED = [
    ("", b"", "de709733a430f17403c9a6484568b0796d561017871f7bacefa28b8b968a50a5"),
    (QWEN_NAMESPACE, b"", "a1b493dace3b74af01c1f3e6f5970bc7cfc92ec4166179310b98f2afc33d9a22"),
    (QWEN_NAMESPACE, PNG_LIKE, "239292be22c2e54a8207bf5016df7a5f8183d02da0d4834ca212c3e4d412645e"),
    ("kimi_k25:e1f130c970e1c733fba836f3", bytes(range(256)) * 4,
     "4919fa91c7372551ea4c1818457ade6123e40bcad08b520693c568e05d618bc6"),
    ("ns:é", b"x", "26d354fd7b2d922d0cf297642f0297dc253cadf565bf2ab5acacbd1b137eecc4"),  # namespace as UTF-8
]

# (namespace, grid_thw, wire dtype enum value, bytes, hash)
PATCHES = [
    (QWEN_NAMESPACE, [1, 4, 4], 1, bytes(range(256)),
     "bb8759a51a6dea3a0ce6c3227b700cf42af6dcd67ca12e5934152be3ab383fa8"),
    (QWEN_NAMESPACE, [1, 4, 4], 4, bytes(range(256)),
     "f0db661c22440a5724c48f32f1bace5241e92edb7693bd733580276f90d22267"),
    (QWEN_NAMESPACE, [2, 8, 4], 3, bytes(range(128)),
     "0fd0c61f449239d91b15fefa9647d9ba84837d54faaa234566f4a015900e8c5e"),
    ("", [1, 2, 2], 0, b"", "67b927eebaf77ea1524298e97beed97e7f881483565b8c2f935cbb25b5461372"),
]

# (preset, load_vision_model keyword arguments, cache_namespace). bfloat16 + torch is what a GPU
# server reports (preprocess "auto" is torch on an accelerator); the device is not in the namespace.
NAMESPACES = [
    ("tiny-qwen2.5-vl", {}, QWEN_NAMESPACE),
    ("tiny-qwen2.5-vl", {"dtype": "bfloat16"}, "qwen2_5_vl:f281dd683fc286968878200f"),
    ("tiny-qwen2.5-vl", {"preprocess": "torch"}, "qwen2_5_vl:aef9a1855f787d0d2628bc6e"),
    ("tiny-qwen2.5-vl", {"dtype": "bfloat16", "preprocess": "torch"}, "qwen2_5_vl:c2d10ae09764e9844d3528eb"),
    ("tiny-kimi-k2.5", {}, "kimi_k25:e1f130c970e1c733fba836f3"),
    ("tiny-kimi-k2.5", {"dtype": "bfloat16"}, "kimi_k25:8c091f97172f2f6e88dea70a"),
    ("tiny-kimi-k2.5", {"preprocess": "torch"}, "kimi_k25:4ee2d78e5da000fb6c4909e5"),
    ("tiny-kimi-k2.5", {"dtype": "bfloat16", "preprocess": "torch"}, "kimi_k25:e2d4d5a10f860b7403423e65"),
]


def test_hash_version_is_the_deployed_one():
    assert hashing.HASH_VERSION == b"encoder.v1/content-hash/1"


@pytest.mark.parametrize("namespace, data, expected", ENCODED)
def test_hash_encoded_golden(namespace, data, expected):
    assert hashing.hash_encoded(namespace, data) == expected


@pytest.mark.parametrize("namespace, grid, dtype, data, expected", PATCHES)
def test_hash_patches_golden(namespace, grid, dtype, data, expected):
    assert hashing.hash_patches(namespace, grid, dtype, data) == expected
    assert hashing.hash_patches(namespace, tuple(grid), dtype, data) == expected  # any sequence of ints


def test_the_wire_dtype_numbers_in_the_hash_are_the_protos():
    # hash_patches hashes the enum's number: renumbering the proto would change every patches key.
    assert (encoder_pb2.DTYPE_UNSPECIFIED, encoder_pb2.DTYPE_FLOAT32, encoder_pb2.DTYPE_FLOAT16,
            encoder_pb2.DTYPE_BFLOAT16, encoder_pb2.DTYPE_UINT8) == (0, 1, 2, 3, 4)


def test_the_one_dtype_table_is_the_deployed_wire():
    # Names, enum numbers (hashed), little-endian element types and sizes that deployed clients read.
    assert [(d.name, d.enum, d.numpy.str, d.itemsize, d.embedding) for d in DTYPES] == [
        ("float32", 1, "<f4", 4, True), ("float16", 2, "<f2", 2, True), ("bfloat16", 3, "<u2", 2, True),
        ("uint8", 4, "|u1", 1, False)]


@pytest.mark.parametrize("preset, kwargs, expected", NAMESPACES,
                         ids=[f"{p}-{'-'.join(kw.values()) or 'default'}" for p, kw, _ in NAMESPACES])
def test_cache_namespace_golden(preset, kwargs, expected):
    model = load_vision_model(preset, **kwargs)
    assert model.cache_namespace == expected
    assert model.front().cache_namespace == expected  # what the server reports and keys its cache with
