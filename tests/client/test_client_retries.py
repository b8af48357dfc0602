"""EncoderClient's retries and deadlines (gRPC's own retry policy); servers and fixtures as in
tests/client/test_client_sync.py."""

from __future__ import annotations

import time

import client_servers
import grpc
import numpy as np
import pytest
from client_servers import Server, namespace
from encoder_client import EncoderClient, EncoderClientError, HashRef, content_hash, hashing
from encoder_client.testing import (
    FAKE_NAMESPACE,
    Failure,
    FakeVisionEncoder,
    fake_embedding,
    serve_fake,
)

pytestmark = pytest.mark.timeout(120)

# The fixtures (fake, srv, target, client, ...) and the fake/real parametrization: tests/client_servers.py.
pytest_generate_tests = client_servers.pytest_generate_tests
FAST_RETRY = client_servers.FAST_RETRY
fake, server_kind, srv, target, real_model, client = (
    client_servers.fake, client_servers.server_kind, client_servers.srv, client_servers.target,
    client_servers.real_model, client_servers.sync_client)


def test_unavailable_is_retried_until_success(target: str, fake: FakeVisionEncoder) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    fake.fail_next += [Failure(grpc.StatusCode.UNAVAILABLE, "starting")] * 2
    with EncoderClient(target, retries=2, **FAST_RETRY) as client:
        (r,) = client.encode([b"img"])
    assert fake.encode_calls == 3
    assert r.num_tokens == fake_embedding(r.content_hash).shape[0]


def test_unavailable_after_the_retries_are_spent_is_raised(target: str, fake: FakeVisionEncoder) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    fake.fail_next += [Failure(grpc.StatusCode.UNAVAILABLE, "draining")] * 3
    with EncoderClient(target, retries=1, **FAST_RETRY) as client, pytest.raises(EncoderClientError) as info:
        client.encode([b"img"])
    assert (info.value.code, info.value.details) == (grpc.StatusCode.UNAVAILABLE, "draining")
    assert fake.encode_calls == 2


def test_a_stream_that_already_sent_chunks_is_not_retried(client: EncoderClient, fake: FakeVisionEncoder) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    fake.fail_next.append(Failure(grpc.StatusCode.UNAVAILABLE, "draining", after_chunks=1))
    with pytest.raises(EncoderClientError) as info:
        client.encode([b"a", b"b"], max_chunk_bytes=32)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert fake.encode_calls == 1


@pytest.mark.parametrize(("code", "details"), [
    (grpc.StatusCode.INVALID_ARGUMENT, "image 1: not a decodable image (PNG header truncated)"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: 512 images waiting"),
    (grpc.StatusCode.INTERNAL, "internal error"),
])
def test_other_errors_are_raised_at_once_with_the_servers_message(
    client: EncoderClient, fake: FakeVisionEncoder, code: grpc.StatusCode, details: str
) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    fake.fail_next.append(Failure(code, details))
    with pytest.raises(EncoderClientError) as info:
        client.encode([b"a", b"b"])
    assert (info.value.code, info.value.details) == (code, details)
    assert str(info.value) == f"{code.name}: {details}"
    assert fake.encode_calls == 1


@pytest.mark.parametrize(("trailers", "pushback", "may_pass"), [
    ((("grpc-retry-pushback-ms", "1000"),), 1000, True),  # a full queue: the same request may pass later
    ((("grpc-retry-pushback-ms", "-1"),), -1, False),  # an image over a limit: no retry can pass
    # gRFC A6: unparseable means do not retry (gRPC's core hands the client its own negative value)
    ((("grpc-retry-pushback-ms", "soon"),), "negative", False),
    ((), None, False),  # gRPC's own message-size refusal sends none
])
def test_a_resource_exhausted_says_whether_a_retry_may_pass(
    client: EncoderClient, fake: FakeVisionEncoder, trailers, pushback, may_pass
) -> None:
    # Fake only: scripted trailers. The real server's are pinned in tests/api/test_server_errors.py and
    # tests/api/test_server_lifecycle.py.
    fake.fail_next.append(Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "over", trailers=trailers))
    with pytest.raises(EncoderClientError) as info:
        client.encode([b"a"])
    got = info.value.retry_pushback_ms
    if pushback == "negative" and got is not None and got < 0:
        got = "negative"
    assert (got, info.value.retry_may_pass) == (pushback, may_pass)
    assert fake.encode_calls == 1  # RESOURCE_EXHAUSTED is never retried by the client itself


def test_an_unknown_hash_is_not_found(client: EncoderClient, srv: Server) -> None:
    with pytest.raises(EncoderClientError) as info:
        client.encode([HashRef("ab" * 32)])
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    if srv.is_fake:
        assert info.value.details == "image 0: content_hash is not cached"
    else:
        assert info.value.details.startswith("image 0: ") and "is not cached" in info.value.details


def test_hash_first_sends_pixels_only_for_what_the_server_does_not_cache(client: EncoderClient, srv: Server) -> None:
    seen, new = srv.image("seen"), srv.image("new")
    (first,) = client.encode([seen])
    again, fresh = client.encode([seen, new], hash_first=True)
    assert again.cache_hit and again.content_hash == first.content_hash
    np.testing.assert_array_equal(again.embedding, first.embedding)
    assert not fresh.cache_hit and fresh.content_hash == content_hash(new, namespace(client))
    srv.assert_embedding(fresh, new)


def test_deadline_exceeded_on_any_server(client: EncoderClient, srv: Server) -> None:
    # The fake is held 60 s; the real server gets more work than a 1 ms deadline allows.
    if srv.is_fake:
        srv.fake.delay_s = 60.0
    images = [srv.image(f"slow {i}", (448, 448)) for i in range(4)]
    start = time.monotonic()
    with pytest.raises(EncoderClientError) as info:
        client.encode(images, timeout_s=0.001)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 10.0


def test_deadline_exceeded(client: EncoderClient, fake: FakeVisionEncoder) -> None:
    # Fake only: the fake's delay holds the call at the server for 60 s.
    fake.delay_s = 60.0  # the server's work: the 0.3 s deadline must end the call long before it
    start = time.monotonic()
    with pytest.raises(EncoderClientError) as info:
        client.encode([b"slow"], timeout_s=0.3)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 10.0  # generous: a loaded 2-core CI machine, and far below 60 s


def test_retries_never_extend_the_deadline(target: str, fake: FakeVisionEncoder) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    fake.fail_next += [Failure(grpc.StatusCode.UNAVAILABLE, "starting")] * 100
    # 100 retries backing off 0.05, 0.1, then 0.2 s (at least half of each, with jitter) would take
    # 10 s or more if they could run past the 0.5 s deadline.
    with EncoderClient(target, retries=100, backoff_base_s=0.05, backoff_max_s=0.2) as client:
        start = time.monotonic()
        with pytest.raises(EncoderClientError) as info:
            client.encode([b"img"], timeout_s=0.5)
    assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert time.monotonic() - start < 4.0  # generous for a loaded CI machine, well below 10 s
    assert 1 < fake.encode_calls < 100


def test_retries_wait_the_backoff_given_to_the_client(target: str, fake: FakeVisionEncoder) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    fake.fail_next += [Failure(grpc.StatusCode.UNAVAILABLE, "starting")] * 2
    # gRPC waits 0.2 s before each retry (backoff_max_s caps the doubling), jittered by +-20%.
    with EncoderClient(target, retries=2, backoff_base_s=0.2, backoff_max_s=0.2) as client:
        start = time.monotonic()
        client.encode([b"img"])
    assert time.monotonic() - start >= 2 * 0.2 * 0.8
    assert fake.encode_calls == 3


def test_more_than_four_retries_are_gRPCs_limit_of_five_attempts(target: str, fake: FakeVisionEncoder) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    fake.fail_next += [Failure(grpc.StatusCode.UNAVAILABLE, "draining")] * 10
    with EncoderClient(target, retries=100, **FAST_RETRY) as client, pytest.raises(EncoderClientError) as info:
        client.encode([b"img"])
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert fake.encode_calls == 5


@pytest.mark.parametrize("retries", [1, 0])
def test_a_request_larger_than_grpcs_default_retry_buffer_is_retried(
    target: str, fake: FakeVisionEncoder, retries: int
) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    image = bytes(range(256)) * (8 * 1024)  # 2 MiB: gRPC's default per-RPC retry buffer is 256 KiB
    fake.fail_next.append(Failure(grpc.StatusCode.UNAVAILABLE, "starting"))
    with EncoderClient(target, retries=retries, **FAST_RETRY) as client:
        if retries:
            (r,) = client.encode([image])
            assert r.content_hash == hashing.hash_encoded(FAKE_NAMESPACE, image)
            assert [req.images[0].encoded == image for req in fake.requests] == [True, True]
        else:
            with pytest.raises(EncoderClientError) as info:
                client.encode([image])
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert fake.encode_calls == 1


def test_with_grpcs_default_retry_buffer_a_large_request_would_not_be_retried(
    target: str, fake: FakeVisionEncoder
) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    # The control for the test above: the buffer the client raises is what makes the retry happen.
    image = bytes(range(256)) * (8 * 1024)
    fake.fail_next.append(Failure(grpc.StatusCode.UNAVAILABLE, "starting"))
    default_buffer = [("grpc.per_rpc_retry_buffer_size", 256 * 1024)]
    with EncoderClient(target, retries=3, channel_options=default_buffer, **FAST_RETRY) as client:
        with pytest.raises(EncoderClientError) as info:
            client.encode([image])
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert fake.encode_calls == 1
        client.encode([b"small"])  # a small request is still retried on the same channel
    fake.fail_next.append(Failure(grpc.StatusCode.UNAVAILABLE, "starting"))
    with EncoderClient(target, retries=3, channel_options=default_buffer, **FAST_RETRY) as client:
        client.encode([b"small again"])
    assert fake.encode_calls == 4


class _FlakyInfo(FakeVisionEncoder):
    """GetModelInfo and Lookup fail UNAVAILABLE a given number of times, then answer."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.unary_calls = 0

    def _flake(self, context: grpc.ServicerContext) -> None:
        self.unary_calls += 1
        if self.failures > 0:
            self.failures -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "starting")

    def GetModelInfo(self, request, context):
        self._flake(context)
        return super().GetModelInfo(request, context)

    def Lookup(self, request, context):
        self._flake(context)
        return super().Lookup(request, context)


def test_unary_calls_are_retried_too() -> None:
    fake = _FlakyInfo(failures=2)
    with serve_fake(fake) as target, EncoderClient(target, retries=2, **FAST_RETRY) as client:
        assert client.model_info().cache_namespace == FAKE_NAMESPACE
        assert fake.unary_calls == 3
        fake.failures = 3
        with pytest.raises(EncoderClientError) as info:
            client.lookup(["0" * 64])
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert fake.unary_calls == 6


def test_unreachable_server_is_unavailable() -> None:
    client = EncoderClient("127.0.0.1:1", timeout_s=5, retries=1, **FAST_RETRY)
    with client, pytest.raises(EncoderClientError) as info:
        client.model_info()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
