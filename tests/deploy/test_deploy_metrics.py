"""The /metrics endpoint of a real server follows Prometheus' conventions and the README's table."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families
from repo_paths import REPO_ROOT

from encoder_service import metrics

pytestmark = pytest.mark.timeout(120)
# The same tests against two worker processes (--devices cpu,cpu): conftest.pytest_generate_tests.
ALSO_WITH_WORKER_PROCESSES = True


@pytest.fixture(scope="module")
def families(encoder_server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(encoder_server.metrics_text())
            if f.name.startswith("encoder_service")}


def test_every_service_metric_has_the_prefix_and_a_unit_suffix_where_it_has_a_unit(families):
    assert len(families) >= 25
    for name, family in families.items():
        assert name.startswith(metrics.PREFIX)
        if family.type == "counter":
            assert all(s.name == name + "_total" for s in family.samples), name
        assert not re.search(r"_(ms|milliseconds|mib|kb|mb)($|_)", name), f"{name}: not a base unit"
        assert family.documentation, f"{name} has no help text"


def test_latency_histograms_resolve_milliseconds(families):
    seconds = [f for n, f in families.items() if n.endswith("_seconds") and f.type == "histogram"]
    assert {f.name for f in seconds} >= {"encoder_service_request_seconds", "encoder_service_queue_seconds",
                                          "encoder_service_preprocess_seconds", "encoder_service_forward_seconds",
                                          "encoder_service_time_to_first_chunk_seconds"}
    for family in seconds:
        bounds = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
        assert bounds[0] <= 0.0005 and 0.001 in bounds and 1.0 in bounds and bounds[-2] >= 30, family.name


DEVICES = {"in-process": ["cpu"], "workers": ["cpu:0", "cpu:1"]}


def test_model_info_names_version_model_backend_device_and_dtype(families, server_mode):
    (sample,) = [s for f in families.values() for s in f.samples if s.name == "encoder_service_model_info"]
    assert sample.value == 1
    assert sample.labels == {"version": "0.1.0", "model": sample.labels["model"], "model_type": "qwen2_5_vl",
                             "backend": "sdpa", "device": ",".join(DEVICES[server_mode]), "dtype": "float32"}


def test_gpu_memory_is_zero_on_a_cpu_model_and_present_for_dashboards(families, server_mode):
    for name in ("encoder_service_gpu_memory_allocated_bytes", "encoder_service_gpu_memory_reserved_bytes"):
        assert [(s.labels, s.value) for s in families[name].samples] == [
            ({"device": d}, 0.0) for d in DEVICES[server_mode]]


def test_every_device_has_its_forward_series_and_an_up_worker_before_its_first_forward(families, server_mode):
    for name in ("encoder_service_forward_batches", "encoder_service_forward_seconds", "encoder_service_workers_up"):
        assert {s.labels["device"] for s in families[name].samples} == set(DEVICES[server_mode]), name
    assert {s.value for s in families["encoder_service_workers_up"].samples} == {1.0}


def test_gpu_memory_collector_reads_each_device_at_scrape_time():
    collector = metrics.GpuMemoryCollector()
    assert [f.samples for f in collector.collect()] == [[], []]  # before the model is loaded
    reported = {"cuda:1": (3 << 30, 4 << 30)}
    collector.sources = {"cuda:0": lambda: (1, 2), "cuda:1": lambda: reported["cuda:1"]}
    reported["cuda:1"] = (5 << 30, 6 << 30)  # read when scraped, not when registered
    got = {f.name: [(s.labels, s.value) for s in f.samples] for f in collector.collect()}
    assert got == {"encoder_service_gpu_memory_allocated_bytes": [({"device": "cuda:0"}, 1.0),
                                                                  ({"device": "cuda:1"}, float(5 << 30))],
                   "encoder_service_gpu_memory_reserved_bytes": [({"device": "cuda:0"}, 2.0),
                                                                 ({"device": "cuda:1"}, float(6 << 30))]}


def test_every_request_code_and_image_source_exists_before_it_happens(families):
    codes = {(s.labels["method"], s.labels["code"]) for s in families["encoder_service_requests"].samples}
    assert {("Encode", "INTERNAL"), ("Lookup", "OK"), ("GetModelInfo", "UNAVAILABLE")} <= codes
    sources = {s.labels["source"] for s in families["encoder_service_images"].samples}
    assert sources == {"encoded", "patches", "content_hash", "video"}


def test_readme_table_lists_every_service_metric(families):
    operations = (REPO_ROOT / "docs" / "operations.md").read_text()
    listed = set(re.findall(r"`(encoder_service_\w+)`", operations))
    for name, family in families.items():
        shown = name + "_total" if family.type == "counter" else name
        assert shown in listed or name + "_info" in listed, f"{shown} missing from the README's metrics table"
