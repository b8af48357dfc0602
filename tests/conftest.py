"""Shared fixtures. Add fixtures; keep the existing ones working."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from encoder_service.benchmarks.reliability.server import EncoderProcess, start_server
from encoder_service.models.base import Decoder, ModelSpec, VisionModel

# vLLM resolves its platform once per process, at the first import that asks for it, from
# VLLM_TARGET_DEVICE (our vllm wheel is not a CPU build): set before any test module imports vLLM
# (tests/video/test_video_sampling.py calls its video loaders, the connector tests build its configs),
# whatever order pytest-xdist runs the files in.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

REPO_ROOT = Path(__file__).resolve().parent.parent


def import_script(relative_path: str):
    """A script of the repository (``bench/soak.py``) imported from its file: bench/ holds scripts, not a
    package on the path."""
    path = REPO_ROOT / relative_path
    name = path.stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# --- a fake VisionModel for fast in-process engine tests ----------------------------------------------


def _decode_fake(data: bytes, _config, _mode: str, max_image_pixels: int | None = None):
    """The fake family's CPU half: ``b"img:T,H,W[:seed]"`` -> its float32 patches as raw bytes."""
    from encoder_service.errors import InvalidInput
    from encoder_service.preprocess.staged import RawPatches

    if not data.startswith(b"img:"):
        raise InvalidInput("not a decodable image: format not recognised")
    parts = data[4:].decode().split(":")
    grid = tuple(int(x) for x in parts[0].split(","))
    seed = int(parts[1]) if len(parts) > 1 else 0
    return RawPatches(FakeVisionModel.patches(grid, seed).tobytes(), "float32", grid)


class FakeVisionModel(VisionModel):
    """A VisionModel whose forward is a fixed matrix: patch_dim 4, merge 2, hidden 8. Everything
    else (staging, validation, the pending result, the front end's view) is VisionModel's own.

    Each token is the mean of its 4 merged patches times a fixed matrix. ``gate`` (a
    threading.Event) lets a test hold the device worker inside a forward; ``batches`` records the
    grids of every forward. Encoded "images" are ``b"img:T,H,W[:seed]"``; other bytes are not images.
    With ``feature_levels`` > 1 each row also holds extra levels (as Qwen3-VL's deepstack does):
    level k is the main embedding times (k + 1) plus k, concatenated after it.
    """

    cache_namespace = "fake:ns"

    def __init__(self, feature_levels: int = 1) -> None:
        self.spec = ModelSpec(model_id="fake", model_type="fake", hidden_size=8, patch_size=2,
                              temporal_patch_size=1, spatial_merge_size=2, in_channels=1,
                              feature_levels=feature_levels)
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.attn_backend = "none"
        self.weight = torch.arange(32, dtype=torch.float32).reshape(4, 8) / 32.0
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a forward (not the warm-up) starts
        self.fail_forward = 0  # n > 0: the n-th forward (not counting warm-ups) raises
        self.batches: list[list[tuple[int, int, int]]] = []
        self.warmups = 0

    @staticmethod
    def patches(grid: Sequence[int], seed: int = 0) -> np.ndarray:
        n = int(np.prod(grid))
        return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)

    def decoder(self) -> Decoder:
        return Decoder(_decode_fake, None, "pil")

    def warmup_inputs(self):
        from encoder_service.preprocess.staged import RawPatches

        return [[RawPatches(bytes(self.num_patches(g) * 4 * 4), "float32", g)] for g in ((1, 4, 4), (1, 8, 4))]

    def reference(self, pixel_values: np.ndarray) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(pixel_values, dtype=np.float32))
        main = x.reshape(-1, 4, 4).mean(1) @ self.weight
        if self.spec.feature_levels == 1:
            return main
        return torch.cat([main * (k + 1) + k for k in range(self.spec.feature_levels)], dim=1)

    def encode_packed(self, pixel_values, grids):
        checked = self.validate(pixel_values, grids)
        # The worker's warm-up forwards are all-zero pixels (of two grid sizes).
        if float(torch.as_tensor(pixel_values).abs().sum()) == 0.0:
            self.warmups += 1
        else:
            self.batches.append([tuple(g) for g in checked])
            self.entered.set()
            self.gate.wait(30)
            if len(self.batches) == self.fail_forward:
                raise RuntimeError(f"forward {self.fail_forward} failed")
        return self.reference(torch.as_tensor(pixel_values).numpy()), tuple(self.num_tokens(g) for g in checked)


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


# --- tools the operations tests run (scripts/ci_tools.sh installs them) ---------------------------------


def find_tool(name: str) -> str | None:
    """A program on PATH or beside this Python (the .venv's bin, also when the venv is not activated)."""
    import shutil

    return shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


# --- under CI, a skip is a failure unless the test may skip -------------------------------------------

ALLOW_SKIP_MARKER = "allow_skip_on_cpu"


def running_under_ci(environ=os.environ) -> bool:
    """CI=true (GitHub Actions, GitLab, .ci/run) or CI=1."""
    return environ.get("CI", "").strip().lower() in ("1", "true", "yes")


class StrictSkips:
    """Under CI a skipped test fails, unless it is marked ``@pytest.mark.allow_skip_on_cpu(reason)``.

    A skip on the CI machine means something CI was meant to provide is missing (a tool
    scripts/ci_tools.sh installs, a test extra, a fixture's server): left a skip, it is a green run
    that tested nothing. Only what cannot exist on the CPU-only CI machine (a GPU, torchvision) is
    marked as allowed, with its reason. Deselected tests (``-m "not gpu"``) never run, so never
    skip; xfail is not a skip. A whole module skipped at import (``pytest.importorskip`` at module
    level, ``pytest.skip(allow_module_level=True)``) cannot be marked: under CI it is an error.
    """

    def __init__(self, ci: bool | None = None) -> None:
        self.ci = running_under_ci() if ci is None else ci
        self.refused: list[str] = []

    @staticmethod
    def allowed_reason(item: pytest.Item) -> str | None:
        marker = item.get_closest_marker(ALLOW_SKIP_MARKER)
        if marker is None:
            return None
        reason = marker.kwargs.get("reason", marker.args[0] if marker.args else None)
        if not isinstance(reason, str) or not reason.strip():
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{ALLOW_SKIP_MARKER} needs a reason, "
                                    f"e.g. @pytest.mark.{ALLOW_SKIP_MARKER}(\"needs a CUDA GPU\")")
        return reason

    def pytest_report_header(self, config) -> str | None:
        if self.ci:
            return f"CI: a skipped test fails unless marked @pytest.mark.{ALLOW_SKIP_MARKER}(reason)"
        return None

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:  # a marker without a reason is refused whether or not the test skips
            self.allowed_reason(item)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if self.ci and report.skipped and not hasattr(report, "wasxfail") and self.allowed_reason(item) is None:
            self._refuse(report, _skip_message(report))
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        report = yield
        if self.ci and report.skipped:
            self._refuse(report, _skip_message(report) + " (a whole module skipped at import)")
        return report

    def _refuse(self, report, why: str) -> None:
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI=true, which is a failure here: {why}\n"
                           f"Provide what the test needs in CI (scripts/ci_tools.sh, the test extras), or, if it "
                           f"cannot exist on the CPU-only CI machine, mark the test "
                           f"@pytest.mark.{ALLOW_SKIP_MARKER}(reason).")
        self.refused.append(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.refused:
            terminalreporter.write_sep("=", f"{len(self.refused)} skip(s) refused under CI=true", red=True)
            for nodeid in self.refused:
                terminalreporter.write_line(nodeid)


def _skip_message(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


def pytest_configure(config) -> None:
    config.pluginmanager.register(StrictSkips(), "strict-skips")


SERVER_LOG_TAIL_LINES = 60
# Every server start_encoder_server started in this process, in order; a test's own are those after
# the count taken when it began.
STARTED_SERVERS: list[EncoderProcess] = []
_SERVERS_BEFORE = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    item.stash[_SERVERS_BEFORE] = len(STARTED_SERVERS)


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
