"""Embeddings through a shared-memory region (EncodeRequest.output_region) instead of the stream:
the real server process (``--shared-memory on``), the real client with ``shared_memory=True``. The
client's two kinds of region where both apply (``region_kind``): a sealed memfd registered on the
server's region socket (what it uses where the server has one; more in test_caller_regions.py) and a
/dev/shm object (against older servers, and where registration is refused)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
from encoder_client import AsyncEncoderClient, EncoderClient, EncoderClientError
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc
from encoder_client.shared_memory import SHM_DIR, OutputRegion, RegionPool, RegionsExhausted, same_host_target
from shm_helpers import our_objects, png

from encoder_service.api.shared_memory import RegionTable, RegionUnusable
from encoder_service.errors import InvalidInput, PermissionDenied

ALSO_WITH_WORKER_PROCESSES = True
ALSO_WITH_GRPC_PROCESSES = True
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def shm_server(start_encoder_server, server_mode):
    workers = ("--devices", "cpu,cpu") if server_mode == "workers" else ()
    return start_encoder_server("--shared-memory", "on", "--max-batch-tokens", "4096", *workers)


@pytest.fixture(scope="module")
def encoder_server(shm_server):  # makes the module run once per server mode (see conftest)
    return shm_server


def dev_shm_client(target: str, *, client_class=EncoderClient, **kwargs):
    """A client whose regions are /dev/shm objects, as against a server without a region socket (an
    older one)."""
    client = client_class(target, shared_memory=True, **kwargs)
    client._use_region_socket(None)
    return client


@pytest.fixture(params=["registered", "dev-shm"])
def region_kind(request) -> str:
    return request.param


def shm_client(target: str, kind: str, *, client_class=EncoderClient, **kwargs):
    if kind == "dev-shm":
        return dev_shm_client(target, client_class=client_class, **kwargs)
    return client_class(target, shared_memory=True, **kwargs)


def check_kind(client, kind: str) -> None:
    """The regions the client's calls lent were of that kind."""
    assert client._regions.registered is (kind == "registered")
    assert bool(our_objects()) is (kind == "dev-shm")


def test_embeddings_through_shared_memory_equal_the_streamed_ones(encoder_server, region_kind):
    images = [png(1), png(2, (80, 120)), png(3)]
    with EncoderClient(encoder_server.target, shared_memory=False) as streamed, \
            shm_client(encoder_server.target, region_kind) as shared:
        want = streamed.encode(images, output_dtype="bfloat16", bf16_as="uint16")
        for _ in range(2):  # new images, then cache hits (the region reused)
            got = shared.encode(images, output_dtype="bfloat16", bf16_as="uint16")
            for g, w in zip(got, want):
                assert g.content_hash == w.content_hash and g.grid_thw == w.grid_thw
                np.testing.assert_array_equal(g.embedding, w.embedding)
        assert got[0].cache_hit
        # The default bf16_as: ml_dtypes.bfloat16, the same bits, and the client's own memory, not a view
        # of the region (which the next call reuses).
        default = shared.encode(images, output_dtype="bfloat16")
        shared.encode([png(9), png(10)], output_dtype="bfloat16")  # the same region, other bytes
        for d, w in zip(default, want):
            assert d.embedding.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(d.embedding.view(np.uint16), w.embedding)
        check_kind(shared, region_kind)


def test_the_region_chunk_says_where_and_carries_no_data(encoder_server):
    region = OutputRegion(1 << 20)
    try:
        request = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=png(4))],
                                            output_region=region.proto())
        with grpc.insecure_channel(encoder_server.target) as channel:
            chunks = list(encoder_pb2_grpc.VisionEncoderStub(channel).Encode(request, timeout=60))
        (chunk,) = chunks
        assert chunk.last and not chunk.data and chunk.token_offset == 0
        assert chunk.region_offset == 64  # after the region's key
        assert chunk.region_bytes == chunk.num_tokens * chunk.hidden_size * 4  # float32 rows
        with EncoderClient(encoder_server.target) as client:
            (want,) = client.encode([png(4)])
        got = region.view(64, chunk.region_bytes).view(np.float32).reshape(chunk.num_tokens, -1)
        np.testing.assert_array_equal(got, want.embedding)
    finally:
        region.close()


def test_an_image_that_does_not_fit_comes_on_the_stream_and_the_next_region_holds_it(encoder_server,
                                                                                       region_kind):
    with EncoderClient(encoder_server.target, shared_memory=False) as client:
        (want,) = client.encode([png(5, (300, 300))])
    with shm_client(encoder_server.target, region_kind, shared_memory_bytes=4096) as client:
        (got,) = client.encode([png(5, (300, 300))])
        np.testing.assert_array_equal(got.embedding, want.embedding)
        assert client._regions.region_bytes >= want.embedding.nbytes
        (again,) = client.encode([png(5, (300, 300))])
        np.testing.assert_array_equal(again.embedding, want.embedding)
        check_kind(client, region_kind)


def test_the_async_client_reads_the_region_too(encoder_server, region_kind):
    async def run():
        async with shm_client(encoder_server.target, region_kind, client_class=AsyncEncoderClient) as client:
            await client.encode([png(9)])  # (a registered client asks for the socket at its first call)
            results = await asyncio.gather(*(client.encode([png(10 + i)]) for i in range(4)))
            check_kind(client, region_kind)
            return results

    results = asyncio.run(run())
    with EncoderClient(encoder_server.target, shared_memory=False) as client:
        for i, (got,) in enumerate(results):
            (want,) = client.encode([png(10 + i)])
            np.testing.assert_array_equal(got.embedding, want.embedding)


def test_close_unlinks_every_region(encoder_server):
    client = dev_shm_client(encoder_server.target)
    client.encode([png(20)])
    assert our_objects()
    client.close()
    assert not our_objects()


def test_a_region_that_is_not_on_the_servers_host_is_a_clear_error(encoder_server):
    request = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=png(21))],
                                        output_region=encoder_pb2.SharedMemoryRegion(name="encoder-nowhere",
                                                                                     size=4096, key=KEY))
    with grpc.insecure_channel(encoder_server.target) as channel, pytest.raises(grpc.RpcError) as err:
        list(encoder_pb2_grpc.VisionEncoderStub(channel).Encode(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "output_region" in err.value.details() and "host" in err.value.details()
    assert "encoder-nowhere" not in err.value.details()  # no error echoes a region's name


@pytest.mark.parametrize("name", ["../etc/passwd", "other-prefix", "encoder-a/b", "encoder-"])
def test_a_region_name_outside_encoder_star_is_invalid(encoder_server, name):
    request = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=png(22))],
                                        output_region=encoder_pb2.SharedMemoryRegion(name=name, size=4096, key=KEY))
    with grpc.insecure_channel(encoder_server.target) as channel, pytest.raises(grpc.RpcError) as err:
        list(encoder_pb2_grpc.VisionEncoderStub(channel).Encode(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "output_region.name" in err.value.details()


def test_model_info_says_the_server_writes_shared_memory(encoder_server):
    with EncoderClient(encoder_server.target) as client:
        assert client.model_info().shared_memory is True


def test_a_server_without_shared_memory_refuses_a_region_clearly(start_encoder_server):
    server = start_encoder_server("--shared-memory", "off")
    try:
        with EncoderClient(server.target, shared_memory=True) as client:
            assert client.model_info().shared_memory is False
            with pytest.raises(EncoderClientError) as err:
                client.encode([png(23)])
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "--shared-memory on" in err.value.details
            assert not our_objects()  # the failed call's region was not kept
        with EncoderClient(server.target) as client:
            assert client.encode([png(23)])[0].num_tokens > 0  # and it goes on serving
            # A plain client (shared_memory="auto") took the refusal as "stream from now on".
            assert not client.uses_shared_memory and not our_objects()
            assert client.encode([png(24)])[0].num_tokens > 0
    finally:
        server.stop()


def test_a_plain_client_on_the_servers_host_gets_shared_memory_with_the_defaults(start_encoder_server):
    server = start_encoder_server()  # no flags: --shared-memory on is the default
    try:
        with EncoderClient(server.target, shared_memory=False) as streamed:
            want = streamed.encode([png(25), png(26)])
        with EncoderClient(server.target) as client:
            assert client.model_info().shared_memory is True
            assert client.uses_shared_memory
            got = client.encode([png(25), png(26)])
            # The call lent the server one of this process's regions: a sealed memfd registered on the
            # server's region socket, which leaves no name in /dev/shm.
            assert client._regions.registered and not our_objects()
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g.embedding, w.embedding)
    finally:
        server.stop()


@pytest.mark.parametrize(("target", "local"), [
    ("127.0.0.1:50051", True), ("localhost:50051", True), ("[::1]:50051", True), ("ipv4:127.0.0.2:1", True),
    ("dns:///localhost:50051", True), ("unix:/tmp/encoder.sock", True),
    ("10.0.0.3:50051", False), ("encoder.svc:50051", False), ("dns:///encoder-headless:50051", False),
])
def test_a_plain_client_tries_shared_memory_only_for_a_target_on_its_host(target, local):
    assert same_host_target(target) is local
    client = EncoderClient(target)
    try:
        assert client.uses_shared_memory is local
    finally:
        client.close()


def test_a_caller_that_shrinks_its_region_mid_call_gets_an_error_and_the_server_serves_on(encoder_server):
    """Earlier releases wrote through a mapping and died with SIGBUS here (a request's own caller,
    or anyone who can truncate the object, could stop the server)."""
    cached = png(30)
    with EncoderClient(encoder_server.target) as client:
        hit = client.encode([cached])[0]
    region = OutputRegion(8 << 20)
    try:
        # The cached image is answered first; the new ones need three forwards (3600 patches each, one
        # per forward under --max-batch-tokens 4096), which run after the cut even on a loaded machine.
        new = [encoder_pb2.Image(encoded=png(seed, (840, 840))) for seed in (31, 33, 34)]
        request = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(content_hash=hit.content_hash), *new],
                                            output_region=region.proto())
        with grpc.insecure_channel(encoder_server.target) as channel:
            call = encoder_pb2_grpc.VisionEncoderStub(channel).Encode(request, timeout=60)
            first = next(call)
            assert first.image_index == 0 and first.region_bytes > 0
            os.truncate(os.path.join(SHM_DIR, region.name), 0)
            with pytest.raises(grpc.RpcError) as err:
                list(call)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert "shrank to 0 bytes" in err.value.details()
    finally:
        region.close()
    assert encoder_server.alive()
    with EncoderClient(encoder_server.target, shared_memory=True) as client:
        assert client.encode([png(32)])[0].num_tokens > 0


def test_a_caller_cannot_have_the_server_write_into_another_callers_region(encoder_server):
    """Any local user can list /dev/shm and put a victim's region name in its own request; without
    the victim's key (only readable by the object's owner) the server refuses and writes nothing."""
    with dev_shm_client(encoder_server.target) as victim:
        victim.encode([png(33)])  # the victim's region now exists, pooled between its calls
        (name,) = our_objects()
        path = os.path.join(SHM_DIR, name)
        with open(path, "rb") as f:
            before = f.read()
        request = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=png(34))],
                                            output_region=encoder_pb2.SharedMemoryRegion(
                                                name=name, size=len(before), key=b"guess" * 4))
        with grpc.insecure_channel(encoder_server.target) as channel, pytest.raises(grpc.RpcError) as err:
            list(encoder_pb2_grpc.VisionEncoderStub(channel).Encode(request, timeout=60))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        with open(path, "rb") as f:
            assert f.read() == before
        assert victim.encode([png(33)])[0].cache_hit


# --- the two ends' region handling, without a server -------------------------------------------------


KEY = bytes(range(32))


def region(name: str, size: int, key: bytes = KEY) -> encoder_pb2.SharedMemoryRegion:
    return encoder_pb2.SharedMemoryRegion(name=name, size=size, key=key)


def keyed_object(path, size: int, key: bytes = KEY) -> None:
    path.write_bytes(key + b"\0" * (size - len(key)))


def test_the_server_writes_only_into_existing_regular_objects(tmp_path):
    table = RegionTable(True, directory=str(tmp_path))
    with pytest.raises(RegionUnusable, match="does not exist"):
        table.writer(region("encoder-x", 100))
    keyed_object(tmp_path / "encoder-x", 200)
    with pytest.raises(InvalidInput, match="larger than"):
        table.writer(region("encoder-x", 201))
    writer = table.writer(region("encoder-x", 190))
    assert writer.place(b"abc") == (64, 3)  # after the owner's key
    assert writer.place(b"d" * 40) == (128, 40)  # each image on a 64-byte boundary
    assert writer.place(b"e" * 1) is None  # past the declared size (190): on the stream instead
    assert (tmp_path / "encoder-x").read_bytes()[:32] == KEY  # the key stays
    assert (tmp_path / "encoder-x").read_bytes()[128:168] == b"d" * 40
    os.mkdir(tmp_path / "encoder-dir")
    with pytest.raises(RegionUnusable):
        table.writer(region("encoder-dir", 100))
    os.mkfifo(tmp_path / "encoder-fifo")
    with pytest.raises(RegionUnusable, match="not a shared-memory object"):  # and the open did not block
        table.writer(region("encoder-fifo", 100))


def test_the_server_writes_only_into_a_region_whose_first_bytes_are_the_callers_key(tmp_path):
    """/dev/shm's names are listable by every user; only the owner can read an object's bytes."""
    table = RegionTable(True, directory=str(tmp_path))
    keyed_object(tmp_path / "encoder-victim", 4096, key=b"victim-" + bytes(range(25)))
    with pytest.raises(PermissionDenied, match="not its key"):
        table.writer(region("encoder-victim", 4096, key=b"attacker" + bytes(range(24))))
    with pytest.raises(InvalidInput, match="16 to 64 bytes"):
        table.writer(region("encoder-victim", 4096, key=b""))
    assert table.writer(region("encoder-victim", 4096, key=b"victim-" + bytes(range(25)))).place(b"ok") == (64, 2)


def test_a_key_of_one_repeated_byte_is_refused(tmp_path):
    """What a region holds between its sizing and its key, had its creator sized it first."""
    table = RegionTable(True, directory=str(tmp_path))
    (tmp_path / "encoder-zeros").write_bytes(b"\0" * 4096)
    with pytest.raises(InvalidInput, match="one byte repeated"):
        table.writer(region("encoder-zeros", 4096, key=b"\0" * 32))


def test_a_client_region_holds_its_key_before_it_has_any_other_size(monkeypatch, tmp_path):
    """No moment where the object is sized and its first bytes are zeros another caller could name."""
    import encoder_client.shared_memory as client_shm

    seen = []
    real = os.posix_fallocate

    def watching(fd, offset, length):
        seen.append((os.fstat(fd).st_size, os.pread(fd, 64, 0)))
        return real(fd, offset, length)

    monkeypatch.setattr(client_shm.os, "posix_fallocate", watching)
    created = OutputRegion(1 << 16, directory=str(tmp_path))
    try:
        assert seen == [(len(created.key), created.key)]
        assert bytes(created.memory[:len(created.key)]) == created.key
    finally:
        created.close()


def test_a_callers_region_may_not_pose_as_a_relays_and_errors_do_not_echo_names(tmp_path):
    table = RegionTable(True, directory=str(tmp_path))
    keyed_object(tmp_path / "encoder-relay-0123-1-x", 4096)
    with pytest.raises(InvalidInput) as err:
        table.writer(region("encoder-relay-0123-1-x", 4096))
    assert "0123" not in str(err.value)
    with pytest.raises(RegionUnusable) as err:
        table.writer(region("encoder-secret-name", 4096))
    assert "secret" not in str(err.value)


def test_a_region_shrunk_under_a_call_is_that_calls_error_not_a_fault(tmp_path):
    table = RegionTable(True, directory=str(tmp_path))
    path = tmp_path / "encoder-s"
    keyed_object(path, 8192)
    writer = table.writer(region("encoder-s", 8192))
    assert writer.place(b"a" * 100) == (64, 100)
    os.truncate(path, 0)  # a write through a mapping past the new end would be SIGBUS
    with pytest.raises(RegionUnusable, match="shrank to 0 bytes"):
        writer.place(b"b" * 100)


def test_the_server_takes_only_the_pages_of_the_calls_own_output(tmp_path):
    """A sparse object claiming a gigabyte costs the server what the call writes, not a gigabyte."""
    table = RegionTable(True, directory=str(tmp_path))
    path = tmp_path / "encoder-sparse"
    with open(path, "wb") as f:
        f.write(KEY)
        f.truncate(1 << 30)
    writer = table.writer(region("encoder-sparse", 1 << 30))
    assert writer.place(b"x" * 10000) == (64, 10000)
    assert os.stat(path).st_blocks * 512 < 1 << 20


def test_a_recreated_object_is_written_anew(tmp_path):
    table = RegionTable(True, directory=str(tmp_path))
    path = tmp_path / "encoder-r"
    keyed_object(path, 256)
    table.writer(region("encoder-r", 256)).place(b"old")
    os.unlink(path)
    keyed_object(path, 256)
    table.writer(region("encoder-r", 256)).place(b"new")
    assert path.read_bytes()[64:67] == b"new"


def test_a_pool_reuses_regions_and_discards_a_failed_calls_region():
    pool = RegionPool(4096)
    try:
        a = pool.acquire()
        pool.release(a, needed_bytes=100, failed=False)
        assert pool.acquire() is a
        pool.release(a, needed_bytes=100, failed=True)
        assert a.closed and pool.acquire() is not a
    finally:
        pool.close()
    assert not our_objects()


def test_a_region_lent_before_a_fork_is_neither_kept_nor_closed_by_the_child():
    """The call that held it ran in the parent: kept in the child's pool, the child would lend the
    parent's region to its own calls; closed there, the parent's object would be unlinked."""
    pool = RegionPool(4096)
    try:
        lent = pool.acquire()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                pool.release(lent, needed_bytes=100, failed=False)
                mine = pool.acquire()
                verdict = b"ok" if mine is not lent and not lent.closed else b"kept or closed"
                pool.release(mine, needed_bytes=100, failed=True)  # the child's own: unlinked by it
            except BaseException as exc:  # reported to the parent
                verdict = repr(exc).encode()[:300]
            os.write(write, verdict)
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as answer:
            assert answer.read() == b"ok"
        assert os.path.exists(f"/dev/shm/{lent.name}")
        pool.release(lent, needed_bytes=100, failed=False)
        assert pool.acquire() is lent  # still the parent's to reuse
        pool.release(lent, needed_bytes=100, failed=True)
    finally:
        pool.close()
    assert not our_objects()


def test_a_pool_grows_for_a_large_call_up_to_its_bound_and_shrinks_back():
    """One call of many references to a cached image (a few bytes each to ask for) must not make
    every later region large."""
    pool = RegionPool(4096, max_region_bytes=8 << 20)
    try:
        region = pool.acquire()
        pool.release(region, needed_bytes=100 << 20, failed=False)  # a call that needed 100 MiB
        assert pool.region_bytes == 8 << 20  # bounded: the rest of such a call comes on the stream
        for _ in range(RegionPool.SIZE_WINDOW):
            region = pool.acquire()
            pool.release(region, needed_bytes=1000, failed=False)
        assert pool.region_bytes == 4096  # back to the initial size once such calls stop coming
        assert pool.acquire().size == 4096
    finally:
        pool.close()


def test_a_pool_holds_at_most_its_total_bound():
    pool = RegionPool(4096, max_total_bytes=3 * 4096)
    try:
        held = [pool.acquire() for _ in range(3)]
        with pytest.raises(RegionsExhausted):
            pool.acquire()
        pool.release(held.pop(), needed_bytes=10, failed=True)  # closed: its bytes are free again
        held.append(pool.acquire())
    finally:
        pool.close()


@pytest.mark.allow_skip_on_cpu(reason="bind-mounting a file takes CAP_SYS_ADMIN")
def test_an_object_from_another_filesystem_mounted_under_a_name_is_refused(tmp_path):
    """A file (or FUSE) mounted under a name in /dev/shm by a user who can mount: the server would
    read and write another filesystem's file (a review bind-mounted a file of /tmp and had the bytes
    land there)."""
    import shutil
    import subprocess
    import tempfile

    directory = tempfile.mkdtemp(prefix="encoder-test-", dir="/dev/shm")
    try:
        outside = tmp_path / "outside"
        keyed_object(outside, 4096)
        keyed_object(Path(directory) / "encoder-bind", 4096)
        if os.stat(directory).st_dev == os.stat(outside).st_dev:
            pytest.skip("the test's temporary directory is on /dev/shm's own filesystem")
        mounted = subprocess.run(["mount", "--bind", str(outside), f"{directory}/encoder-bind"], capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode()[-200:]}")
        try:
            table = RegionTable(True, directory=directory)
            with pytest.raises(RegionUnusable, match="not on the server's /dev/shm"):
                table.writer(region("encoder-bind", 4096))
        finally:
            subprocess.run(["umount", f"{directory}/encoder-bind"], check=True)
        assert RegionTable(True, directory=directory).writer(region("encoder-bind", 4096)).place(b"ok") == (64, 2)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
