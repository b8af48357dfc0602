"""Stream reassembly, bf16 as bfloat16 / widened / raw bits, and the hand-built health codec, without a server."""

from __future__ import annotations

import json
import random
import struct

import grpc
import ml_dtypes
import numpy as np
import pytest
from encoder_client import EncoderClientError, bf16_bits_to_float32
from encoder_client._reassembly import Reassembler
from encoder_client._rpc import RetryPolicy, build_channel_options, health_status_name
from encoder_client.protocol import encoder_pb2
from encoder_client.testing import float32_to_bf16_bits
from grpc_health.v1 import health_pb2

HIDDEN = 4


def _chunks(index: int, emb: np.ndarray, rows_per_chunk: int, dtype: int = encoder_pb2.DTYPE_FLOAT32):
    out = []
    n = emb.shape[0]
    for off in range(0, n, rows_per_chunk):
        out.append(encoder_pb2.EmbeddingChunk(
            image_index=index, content_hash=f"h{index}", grid_thw=[1, 2, 2], num_tokens=n,
            hidden_size=emb.shape[1], dtype=dtype, token_offset=off,
            data=emb[off:off + rows_per_chunk].astype("<f4").tobytes(), last=off + rows_per_chunk >= n,
        ))
    return out


def test_shuffled_chunks_of_several_images_come_back_in_request_order() -> None:
    rng = np.random.default_rng(0)
    embs = [rng.standard_normal((n, HIDDEN)).astype(np.float32) for n in (7, 1, 12)]
    per_image = [_chunks(i, e, rows_per_chunk=2) for i, e in enumerate(embs)]
    # Middle chunks in any order, across and within images; each image's last chunk ends it.
    middles = [c for chunks in per_image for c in chunks[:-1]]
    lasts = [chunks[-1] for chunks in per_image]
    random.Random(1).shuffle(middles)
    random.Random(2).shuffle(lasts)
    r = Reassembler(3, bf16_as="float32", started_s=0.0)
    for chunk in middles + lasts:
        r.add(chunk)
    results = r.results()
    assert [x.index for x in results] == [0, 1, 2]
    for x, e in zip(results, embs, strict=True):
        np.testing.assert_array_equal(x.embedding, e)
        assert x.num_tokens == e.shape[0] and x.hidden_size == HIDDEN and x.dtype == "float32"


def _malformed(chunks: list[encoder_pb2.EmbeddingChunk], num_images: int = 1) -> str:
    r = Reassembler(num_images, bf16_as="float32", started_s=0.0)
    with pytest.raises(EncoderClientError) as info:
        for chunk in chunks:
            r.add(chunk)
        r.results()
    assert info.value.code == grpc.StatusCode.INTERNAL
    return info.value.details


def test_malformed_streams_are_internal_errors() -> None:
    emb = np.ones((4, HIDDEN), np.float32)
    good = _chunks(0, emb, 2)
    assert "image_index 3" in _malformed([encoder_pb2.EmbeddingChunk(image_index=3)])
    assert "stream ended before image 0" in _malformed(good[:1])
    assert "last chunk came with 2 of 4 rows" in _malformed(good[1:])
    assert "sent twice" in _malformed([good[0], good[0]])
    torn = encoder_pb2.EmbeddingChunk()
    torn.CopyFrom(good[0])
    torn.data = torn.data[:-1]
    assert "not whole rows" in _malformed([torn])
    assert "stream ended before image 1" in _malformed(good, num_images=2)


def test_bf16_widening_matches_a_bytewise_reference() -> None:
    values = np.array([0.0, -0.0, 1.0, -2.5, 3.1415927, 1e-30, 6.5e4, np.inf, -np.inf], np.float32)
    bits = float32_to_bf16_bits(values)
    # Reference: a bf16 is the high two bytes of a little-endian float32.
    reference = np.array([struct.unpack("<f", b"\0\0" + struct.pack("<H", int(b)))[0] for b in bits],
                         np.float32)
    np.testing.assert_array_equal(bf16_bits_to_float32(bits), reference)
    finite = np.isfinite(values)
    np.testing.assert_allclose(reference[finite], values[finite], rtol=2**-8)


def test_health_status_names_include_statuses_newer_than_the_library() -> None:
    response = health_pb2.HealthCheckResponse
    assert health_status_name(response()) == "UNKNOWN"
    assert health_status_name(response(status=response.SERVING)) == "SERVING"
    assert health_status_name(response(status=response.SERVICE_UNKNOWN)) == "SERVICE_UNKNOWN"
    # A status value a later grpc.health.v1 might add parses (open enum) and keeps its number.
    assert health_status_name(response.FromString(b"\x08\x07")) == "STATUS_7"


def test_the_retry_policy_is_grpcs_service_config_with_a_retry_buffer_for_whole_requests() -> None:
    policy = RetryPolicy(retries=3, backoff_base_s=0.1, backoff_max_s=0.5)
    options = dict(build_channel_options(64 << 20, [], policy))
    assert options["grpc.enable_retries"] == 1
    assert options["grpc.per_rpc_retry_buffer_size"] == 64 << 20  # the largest request, not 256 KiB
    assert options["grpc.max_send_message_length"] == options["grpc.max_receive_message_length"] == 64 << 20
    (method,) = json.loads(options["grpc.service_config"])["methodConfig"]
    assert method["name"] == [{}]  # every method: Encode, Lookup, GetModelInfo, Health/Check
    assert method["retryPolicy"] == {
        "maxAttempts": 4, "initialBackoff": "0.100000000s", "maxBackoff": "0.500000000s",
        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"],
    }
    # gRPC allows 5 attempts at most; its first backoff is not capped by maxBackoff, so the client caps it.
    clamped = RetryPolicy(retries=100, backoff_base_s=2.0, backoff_max_s=0.5).service_config()
    assert clamped["methodConfig"][0]["retryPolicy"]["maxAttempts"] == 5
    assert clamped["methodConfig"][0]["retryPolicy"]["initialBackoff"] == "0.500000000s"
    # Zero backoff means at once: gRPC needs a positive duration.
    assert RetryPolicy(retries=1, backoff_base_s=0).service_config()["methodConfig"][0]["retryPolicy"][
        "initialBackoff"] == "0.000000001s"
    # No retries: no policy at all (gRPC refuses maxAttempts < 2).
    assert RetryPolicy(retries=0).service_config() is None
    assert "grpc.service_config" not in dict(build_channel_options(1024, [], RetryPolicy(retries=0)))
    with pytest.raises(ValueError, match="retries"):
        RetryPolicy(retries=-1)
    with pytest.raises(ValueError, match="backoff"):
        RetryPolicy(backoff_base_s=-0.1)


def test_a_callers_channel_options_override_the_clients() -> None:
    # gRPC keeps the first option of a key, so the client leaves out its own of a key given.
    extra = [("grpc.per_rpc_retry_buffer_size", 1000), ("grpc.service_config", "{}")]
    options = build_channel_options(1 << 20, extra, RetryPolicy())
    assert [v for k, v in options if k == "grpc.per_rpc_retry_buffer_size"] == [1000]
    assert [v for k, v in options if k == "grpc.service_config"] == ["{}"]


# --- extra feature levels (Qwen3-VL deepstack): rows of main + extra levels, split by the client ---


def _level_chunks(emb_levels: list[np.ndarray], rows_per_chunk: int, feature_levels: int,
                  dtype: int = encoder_pb2.DTYPE_FLOAT32) -> list[encoder_pb2.EmbeddingChunk]:
    """One image's chunks as the server sends them: each row is the levels side by side."""
    rows = np.concatenate(emb_levels, axis=1)
    chunks = _chunks(0, rows, rows_per_chunk, dtype)
    for chunk in chunks:
        chunk.hidden_size = emb_levels[0].shape[1]
        chunk.feature_levels = feature_levels
    return chunks


def test_a_multi_chunk_image_with_three_levels_splits_into_main_and_two_deepstack_arrays() -> None:
    rng = np.random.default_rng(3)
    levels = [rng.standard_normal((7, HIDDEN)).astype(np.float32) for _ in range(3)]
    chunks = _level_chunks(levels, rows_per_chunk=2, feature_levels=3)
    assert len(chunks) == 4
    r = Reassembler(1, bf16_as="float32", started_s=0.0)
    for chunk in reversed(chunks[:-1]):  # rows out of order within the image
        r.add(chunk)
    r.add(chunks[-1])
    (x,) = r.results()
    assert (x.num_tokens, x.hidden_size, x.feature_levels) == (7, HIDDEN, 3)
    np.testing.assert_array_equal(x.embedding, levels[0])
    assert len(x.deepstack) == 2
    for got, sent in zip(x.deepstack, levels[1:], strict=True):
        np.testing.assert_array_equal(got, sent)
    # Views of one buffer, each level contiguous [num_tokens, hidden_size]: nothing copied per level.
    for array in (x.embedding, *x.deepstack):
        assert array.shape == (7, HIDDEN) and array.flags.c_contiguous and not array.flags.owndata
        assert np.shares_memory(array, x.embedding.base)
    assert x.nbytes == 3 * 7 * HIDDEN * 4


def test_bf16_levels_come_back_like_the_main_embedding_in_each_bf16_as() -> None:
    rng = np.random.default_rng(4)
    levels = [rng.standard_normal((5, HIDDEN)).astype(np.float32) for _ in range(2)]
    bits = [float32_to_bf16_bits(level) for level in levels]
    rows = np.concatenate(bits, axis=1)
    chunk = encoder_pb2.EmbeddingChunk(
        image_index=0, num_tokens=5, hidden_size=HIDDEN, feature_levels=2, dtype=encoder_pb2.DTYPE_BFLOAT16,
        data=rows.astype("<u2").tobytes(), last=True)
    for bf16_as, expect in (("float32", [bf16_bits_to_float32(b) for b in bits]), ("uint16", bits),
                            ("bfloat16", [b.view(ml_dtypes.bfloat16) for b in bits])):
        r = Reassembler(1, bf16_as=bf16_as, started_s=0.0)
        r.add(chunk)
        (x,) = r.results()
        for got, want in zip((x.embedding, *x.deepstack), expect, strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # bit for bit


def test_bf16_as_bfloat16_is_a_view_of_the_received_rows_equal_to_the_float32_path() -> None:
    # Several chunks out of order, two levels: the reassembled buffer is the one copy; the bfloat16
    # levels the caller gets are views of it (no float32 widening, no copy), equal to the float32
    # path after .astype(np.float32).
    rng = np.random.default_rng(7)
    levels = [rng.standard_normal((9, HIDDEN)).astype(np.float32) for _ in range(2)]
    bits = np.concatenate([float32_to_bf16_bits(level) for level in levels], axis=1)
    chunks = [encoder_pb2.EmbeddingChunk(
        image_index=0, num_tokens=9, hidden_size=HIDDEN, feature_levels=2, dtype=encoder_pb2.DTYPE_BFLOAT16,
        token_offset=off, data=bits[off:off + 4].astype("<u2").tobytes(), last=off + 4 >= 9)
        for off in range(0, 9, 4)]
    got, received = {}, {}
    for bf16_as in ("bfloat16", "float32"):
        r = Reassembler(1, bf16_as=bf16_as, started_s=0.0)
        for chunk in (chunks[1], chunks[0], chunks[2]):
            r.add(chunk)
        (got[bf16_as],) = r.results()
        received[bf16_as] = r._partials[0].rows  # the reassembly buffer: [levels, tokens, hidden], wire uint16
    x, wide = got["bfloat16"], got["float32"]
    assert x.dtype == "bfloat16" and x.embedding.dtype == ml_dtypes.bfloat16 and wide.embedding.dtype == np.float32
    assert x.nbytes == 2 * 9 * HIDDEN * 2 and wide.nbytes == 2 * x.nbytes
    for array, wide_level in zip((x.embedding, *x.deepstack), (wide.embedding, *wide.deepstack), strict=True):
        assert array.shape == (9, HIDDEN) and array.flags.c_contiguous and not array.flags.owndata
        assert np.shares_memory(array, received["bfloat16"])  # a view of the buffer, not a copy
        assert not np.shares_memory(wide_level, received["float32"])  # float32: a widened copy
        np.testing.assert_array_equal(array.astype(np.float32), wide_level)


def test_chunks_that_disagree_on_feature_levels_are_a_clear_error() -> None:
    rng = np.random.default_rng(5)
    levels = [rng.standard_normal((4, HIDDEN)).astype(np.float32) for _ in range(3)]
    chunks = _level_chunks(levels, rows_per_chunk=2, feature_levels=3)
    chunks[1].feature_levels = 2
    details = _malformed(chunks)
    assert "image 0" in details and "feature_levels" in details and "3" in details and "2" in details


def test_rows_must_be_whole_rows_of_every_level() -> None:
    rng = np.random.default_rng(6)
    levels = [rng.standard_normal((4, HIDDEN)).astype(np.float32) for _ in range(3)]
    (chunk,) = _level_chunks(levels, rows_per_chunk=4, feature_levels=3)
    # Two levels' worth of bytes per row under feature_levels 3: not whole rows.
    chunk.data = np.concatenate(levels[:2], axis=1).astype("<f4").tobytes()
    assert "not whole rows" in _malformed([chunk])


def test_a_model_without_levels_gives_no_deepstack_and_chunks_without_the_field() -> None:
    emb = np.arange(6 * HIDDEN, dtype=np.float32).reshape(6, HIDDEN)
    chunks = _chunks(0, emb, 4)
    assert all(not c.feature_levels for c in chunks)
    r = Reassembler(1, bf16_as="float32", started_s=0.0)
    for chunk in chunks:
        r.add(chunk)
    (x,) = r.results()
    assert x.deepstack == () and x.feature_levels == 1
    np.testing.assert_array_equal(x.embedding, emb)
    assert x.embedding.flags.c_contiguous and x.nbytes == emb.nbytes
