"""Shared fixtures of the whole suite (a folder's own shared fixtures are in its conftest.py: tests/engine,
tests/epd, tests/integrations/vllm). Add fixtures; keep the existing ones working.

Helpers that test modules import are in plain modules beside this file, never imported from ``conftest``
(several conftest.py files share that module name, so ``from conftest import`` would find whichever
pytest loaded last): repo_paths.py (REPO_ROOT, import_script, find_tool), fake_model.py
(FakeVisionModel), strict_skips.py (the CI skip rule), client_servers.py, engine_helpers.py,
server_queue.py, worker_helpers.py, and per folder tests/engine/nvjpeg_stand_in.py, tests/epd/fake_vllm.py,
tests/integrations/vllm/vllm_cpu_engine.py.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator

import pytest

# The shared helpers' asserts report as the test modules' own do (pytest rewrites only test modules and
# conftest.py unless told); before anything imports them.
pytest.register_assert_rewrite("engine_helpers", "server_queue", "worker_helpers", "fake_model", "nvjpeg_stand_in",
                               "fake_vllm", "vllm_cpu_engine")

from fake_model import FakeVisionModel  # noqa: E402
from strict_skips import StrictSkips  # noqa: E402

from encoder_service.benchmarks.reliability.server import EncoderProcess, start_server  # noqa: E402

# vLLM resolves its platform once per process, at the first import that asks for it, from
# VLLM_TARGET_DEVICE (our vllm wheel is not a CPU build): set before any test module imports vLLM
# (tests/video/test_video_sampling.py calls its video loaders, the connector tests build its configs),
# whatever order pytest-xdist runs the files in.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# --- a fake VisionModel for fast in-process engine tests (the class: fake_model.py) ---------------------


@pytest.fixture
def fake_model() -> FakeVisionModel:
    return FakeVisionModel()


# --- the real server as a subprocess -------------------------------------------------------------------


# The reliability harness's server process (encoder_service/benchmarks/reliability/server.py) is the one implementation.
RunningServer = EncoderProcess


@pytest.fixture(scope="session")
def start_encoder_server(tmp_path_factory) -> Iterator[Callable[..., RunningServer]]:
    """Factory: ``start_encoder_server("--cache-bytes", "7000")`` -> a SERVING RunningServer.

    Loopback, a free port, the tiny preset, metrics on a free port. Every server started is
    stopped (SIGTERM, then SIGKILL) at the end of the session if a test did not stop it. A server
    whose main port speaks TLS is waited for on its ``--health-port`` when it has one, else
    through ``credentials`` (grpc.ChannelCredentials able to reach it).
    """
    first = len(STARTED_SERVERS)

    def start(*flags: str, timeout_s: float = 120.0, credentials=None) -> RunningServer:
        server = start_server("--grace-period-s", "20", *flags, log_dir=tmp_path_factory.mktemp("encoder-server"),
                              timeout_s=timeout_s, credentials=credentials)
        STARTED_SERVERS.append(server)
        return server

    yield start
    started = STARTED_SERVERS[first:]
    for server in started:  # all asked to stop at once: each exits on its own (grace, teardown)
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
    for server in started:
        server.stop()


SERVER_MODES = {"in-process": (), "workers": ("--devices", "cpu,cpu"), "grpc-processes": ("--grpc-processes", "2")}


def pytest_generate_tests(metafunc):
    """Modules that set ``ALSO_WITH_WORKER_PROCESSES = True`` run every test on ``encoder_server``
    twice: against the in-process worker and against two worker processes (``--devices cpu,cpu``),
    so the multi-process hand-off passes the same server tests on every push. Modules that set
    ``ALSO_WITH_GRPC_PROCESSES = True`` run them once more behind two relay processes
    (``--grpc-processes 2``): every call passes through a relay, so they pass the same tests."""
    if "encoder_server" not in metafunc.fixturenames:
        return
    modes = ["in-process"]
    if getattr(metafunc.module, "ALSO_WITH_WORKER_PROCESSES", False):
        modes.append("workers")
    if getattr(metafunc.module, "ALSO_WITH_GRPC_PROCESSES", False):
        modes.append("grpc-processes")
    if len(modes) > 1:
        metafunc.parametrize("server_mode", modes, indirect=True, scope="module")


@pytest.fixture(scope="module")
def server_mode(request) -> str:
    return getattr(request, "param", "in-process")


@pytest.fixture(scope="module")
def encoder_server(start_encoder_server, server_mode) -> Iterator[RunningServer]:
    """One shared server per test module (tiny preset, limits small enough to test cheaply),
    stopped when the module is done: idle servers left to the session's end cost its CPU and
    memory, and stopping them all there took 40 s of CI."""
    server = start_encoder_server("--max-batch-tokens", "4096", "--max-message-bytes", str(8 << 20),
                                  "--max-image-pixels", "4000000", *SERVER_MODES[server_mode])
    yield server
    server.stop()


# --- under CI, a skip is a failure unless the test may skip (strict_skips.py) ---------------------------


def pytest_configure(config) -> None:
    config.pluginmanager.register(StrictSkips(), "strict-skips")



SERVER_LOG_TAIL_LINES = 60
# Every server start_encoder_server started in this process, in order; a test's own are those after
# the count taken when it began.
STARTED_SERVERS: list[EncoderProcess] = []
_SERVERS_BEFORE = pytest.StashKey[int]()


_MODULE_SERVERS_BEFORE: dict[str, int] = {}  # by module: the count when its first test began


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    item.stash[_SERVERS_BEFORE] = len(STARTED_SERVERS)
    _MODULE_SERVERS_BEFORE.setdefault(item.module.__name__, len(STARTED_SERVERS))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its fixtures torn down): every server its tests and fixtures started
    stops. The factory is session-scoped, so a server a test started in its body, or a module fixture
    that does not stop its own, would otherwise live to the session's end: dozens of idle servers, ~400 MB
    each, left the vLLM engine tests late in the run without the memory their KV cache needs. No
    fixture wider than a module starts a server."""
    result = yield
    if nextitem is not None and nextitem.module is not item.module:
        first = _MODULE_SERVERS_BEFORE.pop(item.module.__name__, len(STARTED_SERVERS))
        started = [server for server in STARTED_SERVERS[first:] if server.proc.poll() is None]
        for server in started:  # all asked at once: each drains on its own
            server.proc.send_signal(signal.SIGTERM)
        for server in started:
            server.stop()
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used a server process (a fixture's, or one it started through
    start_encoder_server) gets the tail of that server's log in its report: errors the server answers
    with say "the encoder's log says why", and CI keeps only the report."""
    report = yield
    if report.failed and call.when != "collect":
        servers = {n: v for n, v in getattr(item, "funcargs", {}).items() if isinstance(v, EncoderProcess)}
        for n, server in enumerate(STARTED_SERVERS[item.stash.get(_SERVERS_BEFORE, len(STARTED_SERVERS)):]):
            if server not in servers.values():
                servers[f"started by the test #{n + 1}"] = server
        for name, server in servers.items():
            try:
                tail = server.log_text().splitlines()[-SERVER_LOG_TAIL_LINES:]
            except OSError as exc:
                tail = [f"(its log could not be read: {exc})"]
            report.sections.append((f"server log: {name} (last {len(tail)} lines)", "\n".join(tail)))
    return report
