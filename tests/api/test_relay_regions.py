"""The relays' regions handed to the server process by descriptor (api/relay/regions.py): both ends
over a real unix socket, in one process. The server processes that use them are in
test_grpc_processes.py."""

from __future__ import annotations

import asyncio
import os
import socket

import numpy as np
import pytest

from encoder_service.api.relay.regions import RegionBoard, RegionLender


async def settle(condition, timeout_s: float = 5.0) -> None:
    """Lets the board's reader run until ``condition()`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "the board did not get there"
        await asyncio.sleep(0.01)


async def lender_of(board: RegionBoard) -> RegionLender:
    # The lender blocks on the server's answer; the board answers on this loop: connect in a thread.
    return await asyncio.to_thread(RegionLender, board.path)


def test_a_relay_region_cannot_be_shrunk_or_grown(tmp_path):
    async def main():
        board = RegionBoard(str(tmp_path / "regions.sock"))
        board.start()
        lender = await lender_of(board)
        region = await asyncio.to_thread(lender.create, 1 << 20)
        for size in (0, 4096, 2 << 20):  # a shrink would be SIGBUS in the server writing through its mapping
            with pytest.raises(PermissionError):
                os.ftruncate(region.fd, size)
        assert len(board) == 1 and not any(n.startswith("encoder-relay") for n in os.listdir("/dev/shm"))
        lender.close()
        board.close()

    asyncio.run(main())


def test_the_server_writes_what_the_relay_reads_and_forgets_a_dropped_region(tmp_path):
    async def main():
        board = RegionBoard(str(tmp_path / "regions.sock"))
        board.start()
        lender = await lender_of(board)
        region = await asyncio.to_thread(lender.create, 1 << 16)
        lend = lender.lend(region)
        memory = board.memory(lend)
        memory[:5] = np.frombuffer(b"hello", np.uint8)
        assert bytes(region.view(0, 5)) == b"hello"  # one memory, two processes' mappings
        assert board.memory("unknown 1") is None and board.memory("garbage") is None
        region.close()  # tells the server
        await settle(lambda: len(board) == 0)
        assert board.memory(lend) is None
        lender.close()
        board.close()

    asyncio.run(main())


def test_a_callers_slot_waits_for_the_relay_to_give_the_region_back(tmp_path):
    async def main():
        board = RegionBoard(str(tmp_path / "regions.sock"))
        board.start()
        lender = await lender_of(board)
        region = await asyncio.to_thread(lender.create, 1 << 16)
        released = []
        first, second = lender.lend(region), lender.lend(region)
        board.after_return(first, lambda: released.append("first"))
        board.after_return(second, lambda: released.append("second"))
        await asyncio.sleep(0.05)
        assert released == []  # the server is done, the relay still streams
        lender.give_back(first)
        await settle(lambda: released == ["first"])
        # A give-back that arrived before the server's call ended: the slot is released at once.
        lender.give_back(second)
        await settle(lambda: released == ["first", "second"])
        third = lender.lend(region)
        lender.give_back(third)
        await asyncio.sleep(0.05)
        board.after_return(third, lambda: released.append("third"))
        assert released[-1] == "third"
        # A relay that dies gives back everything it had lent.
        fourth = lender.lend(region)
        board.after_return(fourth, lambda: released.append("fourth"))
        lender.close()
        await settle(lambda: released[-1] == "fourth")
        assert len(board) == 0
        board.close()

    asyncio.run(main())


def test_the_server_refuses_a_region_that_could_shrink(tmp_path):
    async def main():
        board = RegionBoard(str(tmp_path / "regions.sock"))
        board.start()

        def send_unsealed() -> bytes:
            fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
            os.ftruncate(fd, 4096)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                sock.settimeout(5)
                sock.connect(board.path)
                socket.send_fds(sock, [b"add abc123 4096"], [fd])
                os.close(fd)
                return sock.recv(256)

        reply = await asyncio.to_thread(send_unsealed)
        assert reply.startswith(b"no not sealed against shrinking"), reply
        assert len(board) == 0
        board.close()

    asyncio.run(main())


def test_a_give_back_the_server_did_not_get_ends_the_connection_and_frees_the_slot(tmp_path):
    """A message that timed out (the server's loop held for the socket's timeout) is lost: kept, the
    connection would leave that call's per-client slot and the region's mapping held until the relay
    dies. The lender ends the connection instead, which frees both, and registers anew."""
    class Lossy:
        def __init__(self, sock):
            self._sock = sock

        def send(self, data):
            raise TimeoutError("timed out")

        def __getattr__(self, name):
            return getattr(self._sock, name)

    async def main():
        board = RegionBoard(str(tmp_path / "regions.sock"))
        board.start()
        lender = await lender_of(board)
        region = await asyncio.to_thread(lender.create, 1 << 16)
        released = []
        lend = lender.lend(region)
        board.after_return(lend, lambda: released.append("slot"))
        lender._sock = Lossy(lender._sock)
        lender.give_back(lend)  # lost
        await settle(lambda: released == ["slot"] and len(board) == 0)
        assert not lender.current(region)
        region.close()  # nothing to tell: the server dropped it with the connection
        again = await asyncio.to_thread(lender.create, 1 << 16)  # through a new connection
        assert lender.current(again) and len(board) == 1
        again.close()
        await settle(lambda: len(board) == 0)
        lender.close()
        board.close()

    asyncio.run(main())
