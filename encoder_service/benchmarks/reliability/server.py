"""A real ``encoder-service serve`` process on loopback: start, wait for SERVING, read /metrics and
/proc, stop. The scenarios' only view of the server is what an operator has: gRPC, /metrics, the
process (its RSS, its exit code) and its log."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[3]

QUEUE_IMAGES = "encoder_service_queue_images"
IN_FLIGHT = "encoder_service_requests_in_flight"
CACHE_BYTES = "encoder_service_cache_bytes"
CACHE_CAPACITY = "encoder_service_cache_capacity_bytes"


@dataclass(frozen=True)
class ServerSpec:
    """What every server of a run shares: the model and the device (the soak's --model/--device)."""

    model: str = ""  # empty: the tiny random-weight preset on the CPU
    device: str = "cpu"
    dtype: str = ""

    def flags(self) -> list[str]:
        out = ["--device", self.device]
        if self.model:
            out += ["--model", self.model]
        if self.dtype:
            out += ["--dtype", self.dtype]
        return out


class MissingSeries(LookupError):
    """/metrics shows no series of that name (with those labels)."""


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _labels(text: str) -> dict[str, str]:
    """'a="1",b="x"' (or 'a="1",b="x"}' as printed) -> {"a": "1", "b": "x"}; values stay escaped."""
    text = text.strip()
    text = text[:-1] if text.endswith("}") else text
    pairs = _LABEL.findall(text)
    if text and ",".join(f'{k}="{v}"' for k, v in pairs) != text.rstrip(","):
        raise ValueError(f"labels {text!r} are not name=\"value\" pairs")
    return dict(pairs)


@dataclass
class EncoderProcess:
    """The tests' ``start_encoder_server`` fixture hands out these too."""

    proc: subprocess.Popen
    log_path: Path
    target: str = ""
    metrics_url: str = ""
    health_target: str = ""  # the plaintext --health-port, when the server has one
    credentials: grpc.ChannelCredentials | None = None  # reaches a TLS main port
    _log_file: object = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics_text(self) -> str:
        """/metrics as served (Prometheus' text format)."""
        return urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by its series name with labels as printed."""
        out = {}
        for line in self.metrics_text().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, name: str, labels: str = "", *, missing_ok: bool = False) -> float:
        """The sum of the series of ``name`` whose labels include ``labels``, in any order: one
        sample, e.g. metric("encoder_service_requests_total", 'method="Encode",code="OK"'); some or
        no labels of a labelled metric, the sum over the rest (the node's figure, e.g. forwards
        over every device).

        No such series on /metrics raises MissingSeries: a renamed or dropped metric must not read
        as 0 (and pass "back to 0"). ``missing_ok=True`` reads it as 0, for a series that may
        legitimately be absent: prometheus-client shows an unlabelled metric from its creation, but
        a labelled one only from its first ``labels(...)``, so a label set the server does not
        create up front (sink failures by pattern and reason) is absent until it first happens."""
        wanted = _labels(labels)
        found = [value for key, value in self.metrics().items()
                 if key.partition("{")[0] == name and wanted.items() <= _labels(key.partition("{")[2]).items()]
        if found:
            return sum(found)
        if missing_ok:
            return 0.0
        raise MissingSeries(f"/metrics shows no series {name}{{{labels}}}" + (
            "" if any(key.partition("{")[0] == name for key in self.metrics()) else f" (no {name} at all)"))

    def metric_sum(self, prefix: str) -> float:
        """Sum of every series of one metric, e.g. requests_total over codes (MissingSeries if none)."""
        return self.metric(prefix)

    def rss_bytes(self) -> int:
        """VmRSS of the server process, from /proc (what the kernel charges it)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def peak_rss_bytes(self) -> int:
        """VmHWM of the server process, from /proc: the most resident memory it has held since it
        started (a peak between two samples of rss_bytes shows here)."""
        return _proc_status_bytes(self.pid, "VmHWM")

    def decoder_pids(self) -> list[int]:
        """The server's video decoder processes: its children started by multiprocessing's spawn
        (``spawn_main`` in their command line), not multiprocessing's resource tracker. With the
        defaults (no --devices worker processes) these are the --video-decode-processes children."""
        return [pid for pid in _children(self.pid) if _is_spawned_child(pid)]

    def cpu_s(self) -> float:
        """User + system CPU seconds the server process has used (its threads; not its children),
        from /proc/<pid>/stat."""
        return _cpu_s(self.pid)

    def decoders_cpu_s(self) -> dict[int, float]:
        """User + system CPU seconds of each decoder process alive now (decoder_pids), by pid."""
        out = {}
        for pid in self.decoder_pids():
            with contextlib.suppress(OSError, ValueError, IndexError):  # exited in between
                out[pid] = _cpu_s(pid)
        return out

    def health(self, timeout_s: float = 2.0) -> str:
        """Asked on the plaintext --health-port when there is one, else on the main port."""
        channel = (grpc.insecure_channel(self.health_target) if self.health_target
                   else grpc.secure_channel(self.target, self.credentials) if self.credentials is not None
                   else grpc.insecure_channel(self.target))
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.proc.returncode


def _proc_status_bytes(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def _cpu_s(pid: int) -> float:
    # Fields after the command name (which may hold spaces and parentheses): state is 3rd, utime 14th.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """Child process ids of ``pid``: /proc/<pid>/task/*/children, else (a kernel without
    CONFIG_PROC_CHILDREN) every process whose parent is ``pid``."""
    found: set[int] = set()
    tasks = Path(f"/proc/{pid}/task")
    try:
        listed = [task / "children" for task in tasks.iterdir()]
    except OSError:
        return []
    if listed and listed[0].exists():
        for path in listed:
            with contextlib.suppress(OSError):  # a thread that ended in between
                found.update(int(word) for word in path.read_text().split())
        return sorted(found)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry))
    return sorted(found)


def _is_spawned_child(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and b"spawn_main" in cmdline and b"tracker" not in cmdline.split(b"spawn_main", 1)[0]


def start_server(*flags: str, spec: ServerSpec = ServerSpec(), log_dir: Path | None = None,
                 timeout_s: float = 180.0, credentials: grpc.ChannelCredentials | None = None) -> EncoderProcess:
    """Starts a server on free ports and returns once its health service says SERVING (asked on its
    --health-port if it has one, else through ``credentials`` when its main port speaks TLS)."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="encoder-reliability-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(tempfile.mkstemp(prefix="server-", suffix=".log", dir=log_dir)[1])
    log_file = open(log_path, "w")  # noqa: SIM115  (closed by EncoderProcess.stop)
    cmd = [sys.executable, "-m", "encoder_service", "serve", "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", "0", *spec.flags(), *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    server = EncoderProcess(proc, log_path, credentials=credentials, _log_file=log_file)
    try:
        _wait_serving(server, timeout_s)
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


def _wait_serving(server: EncoderProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log_text()}")
        text = server.log_text()
        if not server.target and (m := re.search(r"listening on (\S+):(\d+)", text)):
            server.target = f"127.0.0.1:{m.group(2)}"
        if not server.metrics_url and (m := re.search(r"metrics on (http://\S+/metrics)", text)):
            server.metrics_url = m.group(1)
        if not server.health_target and (m := re.search(r"health port \(plaintext.*? on (\S+):(\d+)", text)):
            server.health_target = f"127.0.0.1:{m.group(2)}"
        if server.target and server.metrics_url:
            try:
                if server.health() == "SERVING":
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.1)
    raise TimeoutError(f"server not SERVING after {timeout_s} s:\n{server.log_text()}")


def wait_until(condition, timeout_s: float, interval_s: float = 0.05) -> float | None:
    """Seconds until condition() held, or None if it never did within timeout_s."""
    started = time.monotonic()
    while True:
        if condition():
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            return None
        time.sleep(interval_s)
