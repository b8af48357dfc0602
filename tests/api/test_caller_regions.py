"""Shared-memory regions registered by descriptor (api/caller_regions.py): what a plain client on the
server's host lends by default, and what a hostile local user can send the region socket. Against
the real server process (``--shared-memory on``, its default)."""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import mmap
import os
import socket
import tempfile
import threading

import grpc
import numpy as np
import pytest
from encoder_client import AsyncEncoderClient, EncoderClient, EncoderClientError
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc
from encoder_client.shared_memory import SealedRegion, sealed_memfd
from shm_helpers import our_objects, png

from encoder_service.api import caller_regions

ALSO_WITH_WORKER_PROCESSES = True
ALSO_WITH_GRPC_PROCESSES = True
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def shm_server(start_encoder_server, server_mode):
    workers = ("--devices", "cpu,cpu") if server_mode == "workers" else ()
    return start_encoder_server("--max-batch-tokens", "4096", *workers)


@pytest.fixture(scope="module")
def encoder_server(shm_server):  # makes the module run once per server mode (see conftest)
    return shm_server


@pytest.fixture(scope="module")
def socket_name(encoder_server) -> str:
    with EncoderClient(encoder_server.target) as client:
        name = client.model_info().region_socket
    assert name.startswith("encoder-regions-")
    return name


def connect(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect("\0" + name)
    return sock


def ask(sock: socket.socket, message: str, fds: list[int] = ()) -> str:
    socket.send_fds(sock, [message.encode()], list(fds))
    return sock.recv(256).decode()


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def memfd(size: int, seals: int = SEALS, reserve: bool = True) -> int:
    fd = os.memfd_create("test-region", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if reserve:
        os.posix_fallocate(fd, 0, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def punch_hole(fd: int, offset: int, length: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
    if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, offset, length) != 0:
        raise OSError(ctypes.get_errno(), "fallocate")


def encode_into(target: str, handle: str, image: bytes, **region) -> list[encoder_pb2.EmbeddingChunk]:
    request = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=image)],
                                        output_region=encoder_pb2.SharedMemoryRegion(handle=handle, **region))
    with grpc.insecure_channel(target) as channel:
        return list(encoder_pb2_grpc.VisionEncoderStub(channel).Encode(request, timeout=60))


# --- what a plain client gets --------------------------------------------------------------------------


def test_a_plain_client_registers_sealed_regions_and_gets_the_streamed_embeddings(encoder_server):
    images = [png(1), png(2, (80, 120)), png(3)]
    with EncoderClient(encoder_server.target, shared_memory=False) as streamed, \
            EncoderClient(encoder_server.target) as client:
        want = streamed.encode(images, output_dtype="bfloat16", bf16_as="uint16")
        for _ in range(3):  # new images (the first region is too small), then cache hits in a reused region
            got = client.encode(images, output_dtype="bfloat16", bf16_as="uint16")
            for g, w in zip(got, want):
                assert g.content_hash == w.content_hash
                np.testing.assert_array_equal(g.embedding, w.embedding)
        assert got[0].cache_hit
        assert client._regions.registered
        assert [type(r) for r in client._regions._free] == [SealedRegion]
        assert not our_objects()  # no name in /dev/shm: nothing is left there if this process dies


def test_the_async_client_registers_its_regions_too(encoder_server):
    async def run():
        async with AsyncEncoderClient(encoder_server.target) as client:
            for _ in range(2):
                got = await client.encode([png(4)], output_dtype="bfloat16", bf16_as="uint16")
            return got, client._regions.registered, [type(r) for r in client._regions._free], our_objects()

    got, registered, free, objects = asyncio.run(run())
    with EncoderClient(encoder_server.target, shared_memory=False) as streamed:
        want = streamed.encode([png(4)], output_dtype="bfloat16", bf16_as="uint16")
    np.testing.assert_array_equal(got[0].embedding, want[0].embedding)
    assert registered and free == [SealedRegion] and not objects


def test_the_region_chunk_of_a_registered_region_points_from_offset_0(encoder_server, socket_name):
    with connect(socket_name) as sock:
        fd = memfd(1 << 20)
        try:
            word, handle = ask(sock, f"add {1 << 20}", [fd]).split(" ")
            assert word == "ok" and len(handle) == 32
            (chunk,) = encode_into(encoder_server.target, handle, png(5))
            memory = np.frombuffer(os.pread(fd, chunk.region_bytes, chunk.region_offset), np.float32)
        finally:
            os.close(fd)
    assert chunk.last and not chunk.data and chunk.region_offset == 0
    with EncoderClient(encoder_server.target, shared_memory=False) as streamed:
        want = streamed.encode([png(5)])[0].embedding
    np.testing.assert_array_equal(memory.reshape(want.shape), want)


def test_concurrent_calls_whose_registered_regions_are_dropped_all_get_their_answers(encoder_server):
    """The server forgets every handle while calls of several threads are under way (as a restart
    does): each refused call goes again on the stream, later ones use /dev/shm objects, none fails."""
    seeds = list(range(100, 124))
    with EncoderClient(encoder_server.target, shared_memory=False) as streamed:
        want = {seed: streamed.encode([png(seed)])[0].embedding for seed in seeds}
    for shared_memory in (True, "auto"):
        with EncoderClient(encoder_server.target, shared_memory=shared_memory) as client:
            client.encode([png(seeds[0])])
            assert client._regions.registered
            errors, got, dropped = [], {}, threading.Event()

            def run(my_seeds, client=client, errors=errors, got=got, dropped=dropped):
                try:
                    for i, seed in enumerate(my_seeds):
                        if i == 1:
                            dropped.wait(10)
                        got[seed] = client.encode([png(seed)])[0].embedding
                except Exception as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(seeds[k::6],)) for k in range(6)]
            for t in threads:
                t.start()
            client._regions._registrar._sock.shutdown(socket.SHUT_RDWR)  # the server drops its handles
            dropped.set()
            for t in threads:
                t.join(60)
            assert errors == []
            for seed in seeds:
                np.testing.assert_array_equal(got[seed], want[seed])
            assert not client._regions.registered and client.uses_shared_memory


def test_a_region_lent_while_registration_stopped_is_not_lent_again(encoder_server):
    with EncoderClient(encoder_server.target) as client:
        client.encode([png(20)])
        pool = client._regions
        region = pool.acquire()
        pool.stop_registering()  # e.g. another call's region was refused meanwhile
        pool.release(region, needed_bytes=region.size, failed=False)
        assert region.closed and region not in pool._free
        assert client.encode([png(21)])[0].num_tokens > 0


def test_a_client_whose_registered_region_is_refused_goes_back_to_dev_shm_objects(encoder_server):
    """As after a server restart: the handles the client holds are unknown there."""
    with EncoderClient(encoder_server.target, shared_memory=False) as streamed:
        want = [streamed.encode([png(seed)])[0].embedding for seed in (6, 7, 8)]
    with EncoderClient(encoder_server.target) as client:
        for _ in range(2):
            client.encode([png(6)])
        assert client._regions.registered
        client._regions._registrar._sock.shutdown(socket.SHUT_RDWR)  # the server drops its handles
        got = [client.encode([png(seed)])[0].embedding for seed in (6, 7, 8)]
        assert not client._regions.registered and client.uses_shared_memory and our_objects()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# --- what a hostile local user can send -----------------------------------------------------------------


def test_model_info_names_the_region_socket_only_with_shared_memory_on(start_encoder_server, socket_name):
    server = start_encoder_server("--shared-memory", "off")
    try:
        with EncoderClient(server.target) as client:
            assert client.model_info().region_socket == ""
            assert client.encode([png(9)])[0].num_tokens > 0
            assert not client.uses_shared_memory  # refused, then streamed for good, as before
    finally:
        server.stop()


def _regular_file() -> int:
    fd, path = tempfile.mkstemp()
    os.unlink(path)
    os.ftruncate(fd, 1 << 20)
    return fd


def _pipe() -> int:
    read, write = os.pipe()
    os.close(write)
    return read


@pytest.mark.parametrize(("make", "why"), [
    (lambda: memfd(1 << 20, seals=0), "not sealed against shrinking and growing"),
    (lambda: memfd(1 << 20, seals=fcntl.F_SEAL_SHRINK), "not sealed against shrinking and growing"),
    (lambda: memfd(1 << 20, seals=SEALS | fcntl.F_SEAL_WRITE), "cannot be mapped (Operation not permitted)"),
    (lambda: memfd(1 << 16), "not of its size"),
    (lambda: memfd(1 << 20, reserve=False), "pages not reserved (posix_fallocate them first)"),
    (lambda: memfd(1 << 20, seals=SEALS | fcntl.F_SEAL_SEAL),
     "sealed against further seals: leave F_SEAL_SEAL off, the server seals it against holes"),
    # (a file on tmpfs reads as shmem that was never sealable: sealed with F_SEAL_SEAL alone)
    (_regular_file, ("not a sealed memfd", "not sealed against shrinking and growing")),
    (_pipe, "not a memfd"),
], ids=["unsealed-memfd", "shrink-sealed-only", "write-sealed-memfd", "other-size", "sparse", "seal-sealed",
        "regular-file", "pipe"])
def test_a_descriptor_the_server_cannot_map_safely_is_refused_and_it_serves_on(encoder_server, socket_name,
                                                                                 make, why):
    fd = make()
    try:
        with connect(socket_name) as sock:
            assert ask(sock, f"add {1 << 20}", [fd]) in {f"no {w}" for w in ((why,) if isinstance(why, str) else why)}
            assert ask(sock, f"add {1 << 20}") == "no descriptor: add takes exactly one"
            assert ask(sock, "map /etc/passwd").startswith("no message")
            # Two descriptors in one message: the kernel drops the second (closing it), the server says no.
            assert ask(sock, f"add {1 << 20}", [fd, fd]).startswith("no message: one descriptor at most")
    finally:
        os.close(fd)
    assert encoder_server.alive()
    with EncoderClient(encoder_server.target) as client:
        assert client.encode([png(10)])[0].num_tokens > 0


def test_one_connection_holds_a_bounded_number_of_regions(encoder_server, socket_name):
    fds = []
    try:
        with connect(socket_name) as sock:
            for _ in range(caller_regions.MAX_REGIONS_PER_CONNECTION):
                fds.append(memfd(4096))
                assert ask(sock, "add 4096", [fds[-1]]).startswith("ok ")
            fds.append(memfd(4096))
            assert ask(sock, "add 4096", [fds[-1]]).startswith("no room")
        with connect(socket_name) as sock:  # bytes too, on a connection of its own (checked before the size)
            too_many = caller_regions.MAX_BYTES_PER_CONNECTION + 1
            assert ask(sock, f"add {too_many}", [fds[-1]]).startswith("no room")
    finally:
        for fd in fds:
            os.close(fd)
    with EncoderClient(encoder_server.target) as client:
        assert client.encode([png(11)])[0].num_tokens > 0


def test_an_unknown_or_dropped_handle_is_a_clear_error(encoder_server, socket_name):
    with pytest.raises(grpc.RpcError) as err:
        encode_into(encoder_server.target, "0" * 32, png(12))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "output_region.handle" in err.value.details()
    # A handle is worth nothing once the connection that registered it is gone.
    fd = memfd(1 << 20)
    try:
        with connect(socket_name) as sock:
            handle = ask(sock, f"add {1 << 20}", [fd]).split(" ")[1]
            assert encode_into(encoder_server.target, handle, png(13))[0].region_bytes > 0
        with pytest.raises(grpc.RpcError) as err:
            encode_into(encoder_server.target, handle, png(14))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # ... or once it was dropped.
        with connect(socket_name) as sock:
            handle = ask(sock, f"add {1 << 20}", [fd]).split(" ")[1]
            socket.send_fds(sock, [f"drop {handle}".encode()], [])
            with pytest.raises(grpc.RpcError) as err:
                encode_into(encoder_server.target, handle, png(15))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        os.close(fd)


def test_a_handle_and_a_name_together_are_invalid(encoder_server):
    with pytest.raises(grpc.RpcError) as err:
        encode_into(encoder_server.target, "0" * 32, png(16), name="encoder-x", size=4096, key=bytes(range(32)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "output_region" in err.value.details()


def test_the_clients_region_cannot_change_size_and_has_its_pages():
    """What the client hands over (encoder_client.shared_memory.sealed_memfd): sealed before the
    server sees it, so nothing it does later can turn the server's writes into a SIGBUS."""
    fd = sealed_memfd(1 << 20)
    try:
        assert os.fstat(fd).st_blocks * 512 >= 1 << 20
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 2 << 20)
        # Not sealed against further seals: the server adds its seal against holes once it has mapped it.
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    finally:
        os.close(fd)


def test_no_hole_can_be_punched_in_a_registered_region_and_both_sides_still_write(encoder_server, socket_name):
    """A hole would have the server's writes take pages charged to it (with strict overcommit, a
    SIGBUS), and a hole punched while it writes stalls that write: once mapped, the server seals the
    region against holes. The caller's own mapping, made before, reads and writes as before."""
    fd = memfd(1 << 20)
    mine = mmap.mmap(fd, 1 << 20)
    try:
        with connect(socket_name) as sock:
            handle = ask(sock, f"add {1 << 20}", [fd]).split(" ")[1]
            with pytest.raises(PermissionError):
                punch_hole(fd, 0, 1 << 16)
            with pytest.raises(PermissionError):
                mine.madvise(mmap.MADV_REMOVE, 0, 1 << 16)  # a hole through the mapping: refused too
            assert os.fstat(fd).st_blocks * 512 >= 1 << 20
            mine[:4] = b"mine"
            for seed in (17, 18):
                (chunk,) = encode_into(encoder_server.target, handle, png(seed))
                assert chunk.region_bytes > 0
                assert np.isfinite(np.frombuffer(mine[chunk.region_offset:chunk.region_offset + chunk.region_bytes],
                                                 np.float32)).all()
    finally:
        mine.close()
        os.close(fd)


def test_pages_past_the_end_do_not_pass_for_the_regions_own(encoder_server, socket_name):
    """fallocate(FALLOC_FL_KEEP_SIZE) before sealing puts pages past the end, which st_blocks counts:
    a region of holes then looked reserved, and each call had the server fault pages in. The server
    frees every page past the end before it counts them (the grow seal keeps new ones out)."""
    fd = memfd(1 << 20, seals=0, reserve=False)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        assert libc.fallocate(fd, 1, 1 << 20, 1 << 20) == 0  # FALLOC_FL_KEEP_SIZE: 1 MiB past the end
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        assert os.fstat(fd).st_blocks * 512 >= 1 << 20
        with connect(socket_name) as sock:
            assert ask(sock, f"add {1 << 20}", [fd]) == "no pages not reserved (posix_fallocate them first)"
        assert os.fstat(fd).st_blocks == 0
    finally:
        os.close(fd)
    assert encoder_server.alive()


def test_a_client_used_on_both_sides_of_a_fork_gets_each_process_its_own_embeddings(encoder_server):
    """The pool's regions and its registration are the parent's: lent in a forked child as well, the
    server wrote one process's embeddings into the region the other was reading (hundreds of wrong
    answers in a second), and the child's close shut the parent's registration down."""
    images = {seed: png(seed, (64 + 8 * seed, 64)) for seed in range(50, 58)}
    with EncoderClient(encoder_server.target, shared_memory=False) as streamed:
        want = {seed: streamed.encode([image])[0].embedding for seed, image in images.items()}
    client = EncoderClient(encoder_server.target)
    try:
        client.encode([images[50]])
        assert client._regions.registered
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: half the images, many times; its verdict through the pipe
            verdict = b"ok"
            try:
                for _ in range(20):
                    for seed in (50, 51, 52, 53):
                        if not np.array_equal(client.encode([images[seed]])[0].embedding, want[seed]):
                            verdict = f"wrong embedding for {seed}".encode()
                client.close()
            except BaseException as exc:  # reported to the parent
                verdict = repr(exc).encode()[:500]
            os.write(write, verdict)
            os._exit(0)
        os.close(write)
        for _ in range(20):
            for seed in (54, 55, 56, 57):
                np.testing.assert_array_equal(client.encode([images[seed]])[0].embedding, want[seed])
        os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as verdict:
            assert verdict.read() == b"ok"
        assert client._regions.registered  # the child's close left the parent's registration alone
        np.testing.assert_array_equal(client.encode([images[57]])[0].embedding, want[57])
        assert not our_objects()
    finally:
        client.close()


def test_a_call_refused_as_over_a_limit_keeps_its_region_for_the_next(start_encoder_server):
    """An overload's refusals (most of its calls) must not each cost a new region: a refusal before
    any answer had no row written (measured: 0.3 -> 4.5 s admitted p50 in tests/reliability's overload
    scenario when every refused call's registered region was thrown away and a new one registered)."""
    server = start_encoder_server("--max-queue-images", "2")
    try:
        with EncoderClient(server.target) as client:
            client.encode([png(40)])
            (region,) = client._regions._free
            with pytest.raises(EncoderClientError) as err:
                client.encode([png(41), png(42), png(43)])  # more new images than the queue takes
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert client._regions._free == [region] and not region.closed
            assert client.encode([png(44)])[0].num_tokens > 0
            assert client._regions._free == [region]
    finally:
        server.stop()


def test_after_a_refused_registration_the_pool_makes_dev_shm_regions_for_a_while(monkeypatch):
    """Each refusal costs a memfd and a round trip to the server first: not for every new region."""
    from encoder_client import shared_memory

    asked = []

    class Full:
        def register(self, fd, size):
            asked.append(size)
            raise shared_memory.RegistrationRefused("room: a connection holds at most 256 regions")

        def drop(self, handle):
            pass

        def close(self):
            pass

    pool = shared_memory.RegionPool(1 << 16)
    pool.register_with(Full())
    try:
        first = pool.acquire()
        second = pool.acquire()
        assert len(asked) == 1 and not isinstance(first, SealedRegion) and not isinstance(second, SealedRegion)
        monkeypatch.setattr(shared_memory, "REFUSED_BACKOFF_S", 0.0)
        pool._register_after = 0.0
        pool.acquire()
        assert len(asked) == 2  # tried again once the back-off is over
    finally:
        pool.close()


@pytest.mark.parametrize("limit", [256, 1024, 4096, 1 << 20])
def test_connections_and_regions_together_stay_within_an_eighth_of_the_open_file_limit(limit):
    connections, regions = caller_regions._bounds(limit)
    assert connections >= 1 and regions >= 1
    assert connections <= caller_regions.MAX_CONNECTIONS and regions <= caller_regions.MAX_REGIONS
    if limit // caller_regions.FD_LIMIT_SHARE >= 8:  # (a limit this low leaves one of each)
        assert connections + regions * caller_regions.FDS_PER_REGION <= limit // caller_regions.FD_LIMIT_SHARE


def test_a_registration_whose_mapping_blocks_holds_a_thread_not_the_event_loop(monkeypatch):
    """Punching past the end and sealing take the memfd's inode lock, which its owner can hold for as
    long as it likes (a write() into it from a buffer whose page fault never completes): map_sealed
    runs off the loop, so the loop goes on serving; the caller gets its answer once it returns."""
    release = threading.Event()
    real = caller_regions.map_sealed

    def held(fd, size):
        release.wait(10)
        return real(fd, size)

    monkeypatch.setattr(caller_regions, "map_sealed", held)

    async def run():
        regions = caller_regions.CallerRegions()
        regions.start()
        loop = asyncio.get_running_loop()
        fd = memfd(1 << 20)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect("\0" + regions.name)
            socket.send_fds(sock, [f"add {1 << 20}".encode()], [fd])
            ticks, started = 0, loop.time()
            while loop.time() - started < 0.5:  # the loop runs while the mapping is held
                await asyncio.sleep(0.01)
                ticks += 1
            # ~50 ticks on an idle host; a loop held by the mapping makes one. A busy 2-core host wakes late.
            assert ticks >= 5 and len(regions) == 0
            release.set()
            sock.setblocking(False)
            reply = await loop.sock_recv(sock, 128)
            assert reply.startswith(b"ok ") and len(regions) == 1
            socket.send_fds(sock, [b"drop " + reply[3:]], [])  # read again after the answer
            for _ in range(100):
                if not len(regions):
                    break
                await asyncio.sleep(0.01)
            assert len(regions) == 0
        finally:
            release.set()
            sock.close()
            os.close(fd)
            regions.close()

    asyncio.run(run())


def test_registrations_being_mapped_are_bounded_and_more_are_refused(monkeypatch):
    release = threading.Event()

    def held(fd, size):
        release.wait(10)
        raise caller_regions.Refused("released")

    monkeypatch.setattr(caller_regions, "map_sealed", held)

    async def run():
        regions = caller_regions.CallerRegions()
        regions.start()
        loop = asyncio.get_running_loop()
        socks, fds = [], []
        try:
            for _ in range(caller_regions.MAX_PENDING_ADDS + 1):
                socks.append(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
                socks[-1].connect("\0" + regions.name)
                fds.append(memfd(4096))
                socket.send_fds(socks[-1], [b"add 4096"], [fds[-1]])
            socks[-1].setblocking(False)
            reply = await asyncio.wait_for(loop.sock_recv(socks[-1], 128), 5)
            assert reply == f"no room: {caller_regions.MAX_PENDING_ADDS} registrations are being mapped".encode()
        finally:
            release.set()
            for sock in socks:
                sock.close()
            for fd in fds:
                os.close(fd)
            regions.close()

    asyncio.run(run())


def _answers_within(target: str, seconds: float) -> bool:
    """Whether another caller's GetModelInfo and a streamed Encode both answer within ``seconds``."""
    with EncoderClient(target, shared_memory=False, timeout_s=seconds, retries=0) as other:
        try:
            other.model_info()
            return other.encode([png(70)])[0].num_tokens > 0
        except EncoderClientError:
            return False


@pytest.mark.allow_skip_on_cpu(reason="holding an inode lock takes userfaultfd: root or vm.unprivileged_userfaultfd=1")
def test_a_caller_holding_its_memfds_inode_lock_while_it_registers_holds_up_no_other_call(encoder_server,
                                                                                         socket_name):
    """Punching past the end and sealing wait for the memfd's inode lock, which its owner holds here
    (measured before registrations went off the loop: every call of the server waited 10 s)."""
    import inode_lock

    if (why := inode_lock.why_unavailable()) is not None:
        pytest.skip(why)
    fd = memfd(1 << 20)
    holder = inode_lock.InodeLockHolder(fd)
    try:
        with connect(socket_name) as sock:
            socket.send_fds(sock, [f"add {1 << 20}".encode()], [fd])
            assert _answers_within(encoder_server.target, 5.0)
            holder.release()
            assert sock.recv(128).startswith(b"ok ")  # answered once the lock is let go
    finally:
        holder.release()
        os.close(fd)


@pytest.mark.allow_skip_on_cpu(reason="holding an inode lock takes userfaultfd: root or vm.unprivileged_userfaultfd=1")
def test_a_caller_holding_its_dev_shm_objects_inode_lock_holds_up_no_other_call(encoder_server):
    """tmpfs takes the inode lock for the server's pwrite into a named object (measured before the
    object's I/O went off the loop: every call waited 10 s behind one small image's write)."""
    import inode_lock
    from encoder_client.shared_memory import OutputRegion

    if (why := inode_lock.why_unavailable()) is not None:
        pytest.skip(why)
    region = OutputRegion(1 << 20)
    fd = os.open(f"/dev/shm/{region.name}", os.O_RDWR)
    holder = inode_lock.InodeLockHolder(fd, 1 << 19)
    try:
        done = {}

        def call() -> None:
            try:
                done["chunks"] = list(encoder_pb2_grpc.VisionEncoderStub(grpc.insecure_channel(encoder_server.target))
                                      .Encode(encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=png(71))],
                                                                        output_region=region.proto()), timeout=60))
            except grpc.RpcError as err:
                done["error"] = err.code()

        caller = threading.Thread(target=call)
        caller.start()
        assert _answers_within(encoder_server.target, 5.0)
        holder.release()
        caller.join(60)
        assert done.get("chunks") and done["chunks"][0].region_bytes > 0, done
    finally:
        holder.release()
        os.close(fd)
        region.close()
