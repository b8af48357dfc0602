"""Many encoders and hash-first: cache-affine rendezvous routing, failover, no pixels for cached images."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from encoder_client import EncoderClient, EncoderClientError, RoutingEncoderClient
from encoder_client.routing import rendezvous_rank, resolve_targets
from encoder_client.testing import Failure, FakeVisionEncoder, serve_fake

GRID = (1, 4, 4)


def patches(seed: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    return np.random.default_rng(seed).standard_normal((16, 1176), dtype=np.float32), GRID


def images_by_source(server, source: str) -> float:
    """encoder_service_images_total for one input kind (whatever other labels the series has)."""
    return server.metric("encoder_service_images_total", f'source="{source}"')


@pytest.fixture(scope="module")
def three_encoders(start_encoder_server, tmp_path_factory):
    tmp_path_factory.getbasetemp()  # created once here, not raced by the three starts
    with ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda _: start_encoder_server("--batch-wait-ms", "0"), range(3)))


def test_rendezvous_moves_only_the_images_of_a_removed_target():
    targets = ["a:1", "b:1", "c:1"]
    hashes = [f"{i:064x}" for i in range(300)]
    before = {h: rendezvous_rank(h, targets)[0] for h in hashes}
    after = {h: rendezvous_rank(h, ["a:1", "c:1"])[0] for h in hashes}
    moved = [h for h in hashes if before[h] != after[h]]
    assert moved and all(before[h] == "b:1" for h in moved)
    assert 60 < sum(t == "b:1" for t in before.values()) < 140  # about a third each


def test_dns_name_resolves_to_every_address_and_unreachable_ones_are_skipped(three_encoders):
    port = three_encoders[0].target.rsplit(":", 1)[1]
    assert f"127.0.0.1:{port}" in resolve_targets(f"dns:///localhost:{port}")
    # localhost may also resolve to ::1, where nothing listens: health says so and it is skipped.
    with RoutingEncoderClient(f"dns:///localhost:{port}", health_timeout_s=5.0) as client:  # a loaded CI machine
        results = client.encode([patches(1), patches(2)])
        assert client.healthy_targets() == [f"127.0.0.1:{port}"]
    assert [r.index for r in results] == [0, 1]


def test_resending_fifty_images_hits_the_cache_and_stopping_an_encoder_loses_no_request(three_encoders):
    targets = [s.target for s in three_encoders]
    images = [patches(100 + i) for i in range(50)]
    batches = [list(range(i, i + 5)) for i in range(0, 50, 5)]
    # A generous health timeout: on a loaded 2-core CI machine a busy encoder's answer can take
    # over the default second, and one skipped encoder would break the split checked below.
    with RoutingEncoderClient(targets, health_interval_s=0.5, health_timeout_s=5.0) as client:
        first = {}
        for batch in batches:
            for i, r in zip(batch, client.encode([images[i] for i in batch]), strict=True):
                first[i] = r
        assert all(r.index == k for k, r in enumerate(client.encode([images[i] for i in range(5)])))
        owners = {client.route(first[i].content_hash) for i in range(50)}
        assert owners == set(targets)  # one request's images were split across every encoder

        again = [r for batch in batches for r in client.encode([images[i] for i in batch])]
        hit_ratio = sum(r.cache_hit for r in again) / len(again)
        assert hit_ratio >= 0.95, hit_ratio
        for k, r in enumerate(again):
            np.testing.assert_array_equal(r.embedding, first[k].embedding)

        # Third pass: one encoder is stopped while requests run; every request still completes.
        victim = three_encoders[1]
        done: list[list] = []
        stopper = threading.Thread(target=victim.stop)

        for n, batch in enumerate(batches * 2):
            if n == 3:
                stopper.start()
            results = client.encode([images[i] for i in batch])
            assert [r.content_hash for r in results] == [first[i].content_hash for i in batch]
            for i, r in zip(batch, results, strict=True):
                if rendezvous_rank(first[i].content_hash, targets)[0] != victim.target:
                    np.testing.assert_array_equal(r.embedding, first[i].embedding)  # its owner's cached bytes
                else:  # moved to a new owner and encoded there in another batch: float32 on CPU,
                    # equal up to the summation order of that batch's shapes
                    assert np.linalg.norm(r.embedding - first[i].embedding) <= 1e-5 * np.linalg.norm(
                        first[i].embedding)
            done.append(results)
        stopper.join(60)
        assert len(done) == 20 and victim.proc.poll() is not None
        assert victim.target not in client.healthy_targets()
        # Only the stopped encoder's share moved (about a third): the rest stayed hits throughout,
        # and once the moved ones are encoded on their new owners, everything is a hit again.
        moved = {i for i in range(50) if rendezvous_rank(first[i].content_hash, targets)[0] == victim.target}
        assert 5 < len(moved) < 30
        assert all(r.cache_hit for batch, results in zip(batches * 2, done, strict=True)
                   for i, r in zip(batch, results, strict=True) if i not in moved)
        for batch in batches:
            client.encode([images[i] for i in batch])
        final = [r for batch in batches for r in client.encode([images[i] for i in batch])]
        assert sum(r.cache_hit for r in final) / len(final) >= 0.95


def test_hash_first_sends_no_pixels_for_cached_images(three_encoders):
    server = three_encoders[0]
    images = [patches(500 + i) for i in range(4)]
    with EncoderClient(server.target) as client:
        sent_before = images_by_source(server, "patches")
        first = client.encode(images, hash_first=True)
        assert images_by_source(server, "patches") == sent_before + 4  # misses: pixels sent
        refs_before = images_by_source(server, "content_hash")
        again = client.encode(images, hash_first=True)
        assert images_by_source(server, "patches") == sent_before + 4  # no pixel bytes this time
        assert images_by_source(server, "content_hash") == refs_before + 4
    assert all(r.cache_hit for r in again) and not any(r.cache_hit for r in first)
    for a, b in zip(first, again, strict=True):
        assert a.content_hash == b.content_hash
        np.testing.assert_array_equal(a.embedding, b.embedding)


def test_hash_first_resends_pixels_when_an_entry_is_evicted_after_lookup(three_encoders, monkeypatch):
    server = three_encoders[0]
    images = [patches(600), patches(601)]
    with EncoderClient(server.target) as client:
        # Lookup says "cached" for images the server never saw: exactly what eviction after Lookup looks like.
        monkeypatch.setattr(client, "lookup", lambda hashes, **kw: [True] * len(hashes))
        sent_before = images_by_source(server, "patches")
        results = client.encode(images, hash_first=True)
        assert images_by_source(server, "patches") == sent_before + 2
    assert [r.index for r in results] == [0, 1] and not any(r.cache_hit for r in results)


def refusal(pushback: str) -> Failure:
    return Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, f"refused (pushback {pushback})",
                   trailers=(("grpc-retry-pushback-ms", pushback),))


def test_a_full_encoder_passes_its_images_to_the_next_and_stays_in_the_ring():
    fakes = [FakeVisionEncoder(), FakeVisionEncoder()]
    with serve_fake(fakes[0]) as a, serve_fake(fakes[1]) as b, RoutingEncoderClient([a, b]) as client:
        image = b"photo"
        first = rendezvous_rank(_hash(client, image), [a, b])[0]
        owner, other = (fakes[0], fakes[1]) if first == a else (fakes[1], fakes[0])
        owner.fail_next.append(refusal("1000"))  # its queue is full, once
        (result,) = client.encode([image])
        assert result.index == 0 and (owner.encode_calls, other.encode_calls) == (1, 1)
        client.encode([image])  # the owner was not marked down: the image goes home again
        assert (owner.encode_calls, other.encode_calls) == (2, 1)

        for fake in fakes:  # every encoder full: the refusal comes back, pushback and all
            fake.fail_next.append(refusal("1000"))
        with pytest.raises(EncoderClientError) as info:
            client.encode([image])
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_pushback_ms == 1000


def test_an_image_over_an_encoders_limits_is_not_sent_to_another():
    fakes = [FakeVisionEncoder(), FakeVisionEncoder()]
    with serve_fake(fakes[0]) as a, serve_fake(fakes[1]) as b, RoutingEncoderClient([a, b]) as client:
        for fake in fakes:
            fake.fail_next.append(refusal("-1"))
        with pytest.raises(EncoderClientError) as info:
            client.encode([b"huge"])
        assert info.value.retry_pushback_ms == -1
        assert sum(f.encode_calls for f in fakes) == 1  # a retry elsewhere cannot pass either


def _hash(client: RoutingEncoderClient, image: bytes) -> str:
    from encoder_client._request import content_hash, image_to_proto

    return content_hash(image_to_proto(0, image), client.cache_namespace())


def test_no_healthy_encoder_is_unavailable():
    from encoder_client import EncoderClientError

    with RoutingEncoderClient(["127.0.0.1:1"], health_timeout_s=0.2) as client, \
            pytest.raises(EncoderClientError) as exc:
        client.encode([patches(1)])
    assert exc.value.code.name == "UNAVAILABLE"


def test_cli_encode_routes_over_several_targets_and_hash_first_skips_cached_pixels(tmp_path, capsys):
    from encoder_client.cli import main
    from encoder_client.testing import FakeVisionEncoder, serve_fake

    files = []
    for i in range(12):  # 6 could all rank first on one target (1 run in 32)
        files.append(tmp_path / f"{i}.png")
        files[-1].write_bytes(f"image {i}".encode())
    fakes = [FakeVisionEncoder(), FakeVisionEncoder()]
    with serve_fake(fakes[0]) as t0, serve_fake(fakes[1]) as t1:
        assert main(["encode", "--target", f"{t0},{t1}", "--repeat", "2", *map(str, files)]) == 0
        assert all(len(f.requests) > 0 for f in fakes)  # the images were split over both
        rows = capsys.readouterr().out.splitlines()[1:]
        assert [r.split()[5] for r in rows] == ["no"] * 12 + ["yes"] * 12
        pixels_sent = sum(im.WhichOneof("source") == "encoded" for f in fakes for r in f.requests for im in r.images)
        assert pixels_sent == 12  # the repeat referenced every image by hash
        assert main(["encode", "--target", t0, "--hash-first", str(files[0])]) == 0
