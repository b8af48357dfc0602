"""The Grafana dashboard: generated, fresh, and built the way Grafana imports it."""

from __future__ import annotations

import importlib.util
import json
import re

from repo_paths import REPO_ROOT

GRAFANA = REPO_ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "encoder-service.json"


def generator():
    spec = importlib.util.spec_from_file_location("generate_dashboard", GRAFANA / "generate_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_dashboard_json_is_what_the_generator_writes():
    assert DASHBOARD.read_text() == generator().render(), (
        "deploy/grafana/encoder-service.json is stale: run python deploy/grafana/generate_dashboard.py")


def test_dashboard_has_the_instance_and_datasource_variables():
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["includeAll"] and variables["instance"]["multi"]


def test_every_query_is_filtered_by_the_instance_variable():
    for panel in panels():
        for target in panel["targets"]:
            selectors = re.findall(r"\b(\w+)\{([^}]*)\}", target["expr"])
            assert selectors, (panel["title"], target["expr"])
            for metric, matchers in selectors:
                assert 'instance=~"$instance"' in matchers, (panel["title"], metric)


def test_panels_cover_what_an_operator_watches():
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels()}
    everything = " ".join(exprs.values())
    for metric in ("images_total", "tokens_encoded_total", "request_seconds_bucket", "queue_seconds_bucket",
                   "preprocess_seconds_bucket", "forward_seconds_bucket", "time_to_first_chunk_seconds_bucket",
                   "cache_hits_total", "cache_misses_total", "cache_bytes", "queue_images", "batch_images",
                   "batch_tokens", "requests_total", "gpu_memory_allocated_bytes", "gpu_memory_reserved_bytes"):
        assert "encoder_service_" + metric in everything, metric
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(encoder_service_queue_seconds_bucket" in everything


def test_panel_ids_are_unique_and_panels_do_not_overlap():
    all_panels = json.loads(DASHBOARD.read_text())["panels"]
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in all_panels:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, p["title"]
        cells |= mine
