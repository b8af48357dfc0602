"""The server raises its soft open-file limit at start (encoder_service/fd_limit.py): a real server
process started the way many hosts start processes, at a soft limit far under the hard one."""

from __future__ import annotations

import resource

import pytest

from encoder_service.fd_limit import TARGET, raise_open_file_limit


def _soft_limit_of(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no 'Max open files' line")


def test_a_server_started_at_a_low_soft_limit_raises_it(start_encoder_server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    expected = min(TARGET, hard) if hard != resource.RLIM_INFINITY else TARGET
    if hard <= 256:
        pytest.skip(f"the hard limit here ({hard}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the server inherits it
    try:
        server = start_encoder_server()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert _soft_limit_of(server.proc.pid) == max(expected, 256)
    assert server.health() == "SERVING"
    server.stop()


def test_the_limit_is_never_lowered_nor_raised_past_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert raise_open_file_limit(target=16) == soft  # under the soft limit: left alone
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)
    if hard != resource.RLIM_INFINITY:
        assert raise_open_file_limit(target=hard + 1000) == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
