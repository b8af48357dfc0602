"""The benchmark's FLOP count (what 'share of the GEMM ceiling' divides by) against the hand count below."""

from pathlib import Path

import pytest

from encoder_service.benchmarks.forward import grids_for, model_flops
from encoder_service.models.presets import PRESETS
from encoder_service.models.qwen2_5_vl.model import Qwen2_5_VisionConfig


def test_qwen_7b_costs_about_1_4_gflop_per_patch_at_1008px():
    cfg = Qwen2_5_VisionConfig.from_dict(PRESETS["qwen2.5-vl-7b"].vision_config)
    grids = grids_for([(1008, 1008)])
    assert grids == [[1, 72, 72]]
    per_patch = model_flops(cfg, grids) / (72 * 72)
    # Hand count: ~1.40 GFLOP per patch (GEMMs 1.29, attention 0.11) for a 1008x1008 image.
    assert 1.35e9 < per_patch < 1.45e9


def test_the_service_benchmark_runs_end_to_end_through_the_cli(tmp_path):
    # `encoder-service bench service`: a real server process, client processes, JPEGs, a report.
    import json
    import subprocess
    import sys

    out = tmp_path / "service.json"
    subprocess.run([sys.executable, "-m", "encoder_service", "bench", "service", "--model", "tiny-qwen2.5-vl",
                    # 100 images a level (the level still ends after --seconds 1): the server's counters are
                    # read over HTTP at the window's start, and on a loaded machine a level of 4, and once
                    # (a CI run on 2026-12-01) one of 12, ended before that read, leaving the window without
                    # images and the level without per-image server figures.
                    "--device", "cpu", "--dtype", "float32", "--concurrency", "1", "--seconds", "1",
                    "--images-per-level", "100", "--client-procs", "1", "--hit-iters", "2", "--forward-iters", "1",
                    "--forward-batches", "1,2", "--depth", "2", "--client-start-s", "3",
                    "--transports", "stream,shared-memory", "--out", str(out), "--", "--max-batch-tokens", "65536"],
                   check=True, capture_output=True, timeout=240)
    report = json.loads(out.read_text())
    assert report["command"].startswith("encoder-service bench service --model tiny-qwen2.5-vl")
    assert report["model"].startswith("tiny-qwen2.5-vl with 2 block(s)")  # --depth: a cut checkpoint served
    assert sorted(report["forward_only"]["by_batch"]) == ["1", "2"] and report["forward_only"]["batch"] == 2
    # The server process's CPU per image (Linux /proc): the front end's cost.
    assert all(r["server_cpu_ms_per_image"] > 0 for r in report["new_images"])
    assert all(r["client_cpu_ms_per_image"] > 0 for r in report["new_images"])  # and the clients' own
    assert [r["transport"] for r in report["new_images"]] == ["stream", "shared-memory"]
    assert all(r["images"] > 0 and r["latency_p50_ms"] > 0 for r in report["new_images"])
    # The forward per image under the load, from the server's /metrics (the (b) beside forward-only's (a)).
    assert all(r["server_forward_ms_per_image"] > 0 and r["server_images_per_batch"] >= 1 for r in report["new_images"])
    assert [h["transport"] for h in report["cache_hits"]] == ["stream", "shared-memory"]
    assert report["cache_hits"][1]["embedding_bytes"] == report["cache_hits"][0]["embedding_bytes"] > 0


@pytest.mark.parametrize(("argv", "runs"), [
    (["bench", "forward", "--out", "r.json"], ("forward", ["--out", "r.json"])),
    (["bench", "service", "--seconds", "1", "--", "--cache-bytes", "0"],
     ("service", ["--seconds", "1", "--", "--cache-bytes", "0"])),
    (["bench", "video", "--clips", "2"], ("video", ["--clips", "2"])),
])
def test_bench_runs_the_named_benchmark_with_the_rest_of_the_arguments(monkeypatch, capsys, argv, runs):
    from encoder_service import cli

    ran = []
    monkeypatch.setattr(cli, "_run_benchmark", lambda name, args: ran.append((name, args)) or 0)
    assert cli.main(argv) == 0
    assert ran == [runs] and capsys.readouterr().err == ""


@pytest.mark.parametrize(("argv", "runs"), [
    (["bench"], ("forward", [])),
    (["bench", "--out", "r.json", "--iters", "3"], ("forward", ["--out", "r.json", "--iters", "3"])),
    (["bench", "--service", "--seconds", "1", "--", "--video-decode", "nvdec"],
     ("service", ["--seconds", "1", "--", "--video-decode", "nvdec"])),
    (["bench", "--service", "--model", "m", "--video", "--clips", "2", "--", "--video"],
     ("video", ["--model", "m", "--clips", "2", "--", "--video"])),  # after "--": the server's, left as it is
])
def test_the_spellings_from_before_the_subcommands_still_run_with_a_one_line_notice(monkeypatch, capsys, argv, runs):
    # Scripts written for `bench --service [--video]` and `bench --out ...` keep working for one release.
    from encoder_service import cli

    ran = []
    monkeypatch.setattr(cli, "_run_benchmark", lambda name, args: ran.append((name, args)) or 0)
    assert cli.main(argv) == 0
    assert ran == [runs]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "deprecated" in err and f"encoder-service bench {runs[0]} " in err


def test_the_video_benchmark_measures_clips_and_images_of_their_token_size_through_one_server(tmp_path):
    # `encoder-service bench video`: MP4 clips, then images as large as one temporal slice
    # of them, through one real server process from client processes; tokens/s of both and their ratio.
    import json
    import subprocess
    import sys

    from pytest import approx

    out = tmp_path / "video.json"
    subprocess.run([sys.executable, "-m", "encoder_service", "bench", "video",
                    "--model", "tiny-qwen2.5-vl", "--device", "cpu", "--dtype", "float32", "--clip-seconds", "2",
                    # Levels of up to 12 clips and 40 images, ended by --seconds 2: the server's counters are
                    # read at the window's start, and a level of 2 clips once (a CI run on 2026-12-01) ended
                    # before that read, leaving the window without frames.
                    "--frame-sizes", "64x48", "--source-fps", "10", "--clips", "12", "--distinct-clips", "2",
                    "--images-per-level", "40", "--concurrency", "1", "--seconds", "2", "--client-procs", "1",
                    "--client-start-s", "2", "--out", str(out)],
                   check=True, capture_output=True, timeout=240)
    report = json.loads(out.read_text())
    assert report["command"].startswith("encoder-service bench video --model tiny-qwen2.5-vl")
    [group] = report["video"]["groups"]
    assert group["frames"] == 4 and group["grid_thw"][0] == 2  # 2 s at 2 fps: 4 frames, 2 temporal patches
    [clips] = report["video_runs"]
    assert clips["clips"] >= 2 and clips["cache_hits"] == 0  # every clip new work
    assert clips["clips_per_s"] > 0 and clips["latency_p99_ms"] >= clips["latency_p50_ms"] > 0
    assert clips["tokens_per_s"] == approx(clips["clips_per_s"] * group["tokens"])
    assert clips["frames_per_s"] == approx(clips["clips_per_s"] * 4)
    assert clips["server_cpu_ms_per_frame"] > 0  # the server and its decoder processes, from /proc
    assert 0 < clips["front_end_cpu_cores"] < clips["server_cpu_cores"]  # the front end's own share of it
    # Where a clip's time went, from the server's /metrics over the window.
    assert clips["decode_mean_ms"] > 0 and clips["frames_mean_ms"] > 0 and clips["queue_mean_ms"] > 0
    assert clips["decoder_wait_mean_ms"] >= 0
    [images] = report["image_runs"]
    assert images["images"] > 0 and images["cache_hits"] == 0 and images["server_cpu_ms_per_image"] > 0
    # An image is one temporal slice of the clip: the same tokens per slice.
    assert images["tokens_per_s"] / images["images_per_s"] == approx(group["tokens"] / group["grid_thw"][0])
    assert clips["ratio_to_image_tokens"] == report["video_to_image_tokens_ratio"] > 0


def test_the_qwen3_vl_benchmark_counts_the_towers_gemm_flops_exactly():
    # torch's FLOP counter sees every matmul of the tiny tower's forward (patch embedding, blocks,
    # merger and deepstack mergers) but not the CPU attention kernel: compare the rest.
    import sys

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from qwen3_vl_throughput import attention_flops, tower_flops

    from encoder_service.models import load_vision_model

    model = load_vision_model("tiny-qwen3-vl", attn_backend="sdpa")
    grids = [[1, 4, 6], [2, 8, 8]]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), model.spec.patch_dim)
    with FlopCounterMode(display=False) as counter:
        model.encode_packed(pixels, grids)
    assert counter.get_total_flops() == tower_flops(model.cfg, grids) - attention_flops(model.cfg, grids)


def test_forward_only_per_image_is_read_at_the_batch_size_the_load_had():
    from encoder_service.benchmarks.report import forward_only_ms_per_image

    fo = {"by_batch": {"1": {"ms_per_image": 20.0}, "4": {"ms_per_image": 17.0}, "8": {"ms_per_image": 14.0}}}
    assert forward_only_ms_per_image(fo, 5.0) == 16.25  # between 4 and 8
    assert forward_only_ms_per_image(fo, 0.5) == 20.0 and forward_only_ms_per_image(fo, 12) == 14.0
    assert forward_only_ms_per_image({}, 4) is None


def test_the_device_time_under_load_separates_preprocessing_from_the_forward():
    from encoder_service.benchmarks.report import forward_under_load

    before = {"seconds": 1.0, "batches": 2, "images": 10, "device_preprocess_seconds": 0.1, "cpu_seconds": 5.0}
    after = {"seconds": 2.0, "batches": 12, "images": 60, "device_preprocess_seconds": 0.2, "cpu_seconds": 6.0}
    r = forward_under_load(before, after)
    assert r["server_images_per_batch"] == 5 and r["server_forward_ms_per_image"] == 20
    assert abs(r["server_device_preprocess_ms_per_image"] - 2) < 1e-9
    assert abs(r["server_forward_without_preprocess_ms_per_image"] - 18) < 1e-9
    assert r["server_cpu_ms_per_image"] == 20


def test_a_shallow_checkpoint_keeps_the_widths_and_refuses_to_drop_deepstack_levels(tmp_path):
    import pytest

    from encoder_service.models import load_vision_model
    from encoder_service.models.presets import write_shallow_checkpoint

    path = write_shallow_checkpoint("tiny-qwen2.5-vl", 1, tmp_path / "q")
    model = load_vision_model(str(path))
    full = load_vision_model("tiny-qwen2.5-vl")
    assert model.spec.fingerprint["vision_config"]["depth"] == 1
    assert model.spec.row_width == full.spec.row_width and model.patch_dim == full.patch_dim
    with pytest.raises(ValueError, match="deepstack"):
        write_shallow_checkpoint("tiny-qwen3-vl", 1, tmp_path / "q3")


def test_a_narrow_shallow_checkpoint_keeps_the_output_width_and_preprocessing(tmp_path):
    import json

    from encoder_service.models.presets import get_preset, write_shallow_checkpoint

    path = write_shallow_checkpoint("qwen2.5-vl-7b", 1, tmp_path / "n", narrow=True)
    vision = json.loads((path / "config.json").read_text())["vision_config"]
    full = get_preset("qwen2.5-vl-7b").vision_config
    assert (vision["depth"], vision["hidden_size"], vision["num_heads"]) == (1, 64, 1)
    assert vision["out_hidden_size"] == full["out_hidden_size"] == 3584  # the embeddings' bytes stay
    with pytest.raises(ValueError, match="out_hidden_size"):
        write_shallow_checkpoint("tiny-qwen3-vl", 1, tmp_path / "q3", narrow=True)


def test_the_multi_gpu_scaling_benchmark_runs_its_setups_with_worker_processes(tmp_path):
    # bench/multi_gpu_scaling.py is what the two-GPU gpu test runs: on CPU workers (--devices cpu) it
    # must still start each setup's server, drive it and report, so a broken option surfaces here.
    # Images enough not to run out within the window: clients out of new images end it early, and a
    # window with no forward in it has no per-image figures (a loaded CI machine saw that with 8).
    import json
    import subprocess
    import sys

    from repo_paths import REPO_ROOT

    out = tmp_path / "scaling.json"
    subprocess.run([sys.executable, "bench/multi_gpu_scaling.py", "--setups", "cpu", "--device", "cpu",
                    "--model", "tiny-qwen2.5-vl", "--dtype", "float32", "--concurrency", "2", "--client-procs", "1",
                    "--seconds", "2", "--images", "48", "--client-start-s", "2", "--transport", "shared-memory",
                    "--out", str(out), "--", "--max-batch-tokens", "65536"],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=240)
    report = json.loads(out.read_text())
    assert report["transport"] == "shared-memory"
    [setup] = report["setups"]
    assert setup["devices"] == "cpu" and setup["transport"] == "shared-memory"
    assert setup["images"] > 0 and setup["ratio_to_first"] == 1.0
    assert setup["server_cpu_ms_per_image"] > 0  # the front end's own CPU, sampled over the window
    assert setup["worker_cpu_ms_per_image"]["cpu:0"] > 0  # the worker's own, per image it ran
    # The event loop's thread apart (a clock tick is 10 ms: a short window may show none of it).
    assert 0 <= setup["event_loop_cpu_ms_per_image"] <= setup["server_cpu_ms_per_image"]
    assert setup.get("event_loop_busy_share", 0) <= 1.0


def test_lone_pairs_compares_two_servers_image_by_image(tmp_path):
    # bench/lone_pairs.py: both servers up at once, every new image to both in alternating order, then
    # hits; the report pairs them (B - A per image) so a machine's drift reaches both sides alike.
    import json
    import subprocess
    import sys

    from repo_paths import REPO_ROOT

    out = tmp_path / "pairs.json"
    subprocess.run([sys.executable, "bench/lone_pairs.py", "--model", "tiny-qwen2.5-vl", "--device", "cpu",
                    "--dtype", "float32", "--image-size", "112", "--pairs", "8", "--warmup", "2", "--hit-pairs", "6",
                    "--b-args", "--cache-bytes 0", "--a-client-stream", "threads", "--out", str(out)],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=240)
    report = json.loads(out.read_text())
    assert (report["a"]["client_stream"], report["b"]["client_stream"]) == ("threads", "single")
    assert report["new_images"]["a"]["n"] == report["new_images"]["b"]["n"] == 8
    assert report["cache_hits"]["a"]["n"] == 6
    # B runs without a cache: its "hits" are new work each time, slower than A's true hits.
    assert report["cache_hits"]["b"]["p50_ms"] > report["cache_hits"]["a"]["p50_ms"]
    low, high = report["new_images"]["b_minus_a"]["ci95_ms"]
    assert low <= report["new_images"]["b_minus_a"]["median_ms"] <= high


def test_the_paired_difference_is_the_median_of_b_minus_a():
    import importlib.util

    from repo_paths import REPO_ROOT

    spec = importlib.util.spec_from_file_location("lone_pairs", REPO_ROOT / "bench" / "lone_pairs.py")
    lone_pairs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lone_pairs)
    result = lone_pairs.paired_difference([10.0, 20.0, 30.0, 40.0, 50.0], [9.0, 18.0, 27.0, 41.0, 45.0])
    assert result["median_ms"] == -2.0 and result["b_faster_in"] == 0.8
    assert result["ci95_ms"][0] <= -2.0 <= result["ci95_ms"][1]


def test_lone_pairs_leaves_the_asked_quiet_before_each_pair():
    # --gap-s: each pair of new images comes after that much quiet, so that both servers have gone idle
    # (trimmed their memory) as a lightly loaded fleet's servers have.
    import importlib.util
    import itertools
    import time

    from repo_paths import REPO_ROOT

    spec = importlib.util.spec_from_file_location("lone_pairs", REPO_ROOT / "bench" / "lone_pairs.py")
    lone_pairs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lone_pairs)
    calls: list[tuple[str, float]] = []

    class Client:
        def __init__(self, side: str) -> None:
            self.side = side

        def encode(self, images, **kw):
            calls.append((self.side, time.monotonic()))

    times = lone_pairs.run_pairs({"a": Client("a"), "b": Client("b")}, [b"1", b"2", b"3"], warmup=1, gap_s=0.2)
    assert len(times["a"]) == len(times["b"]) == 2
    assert [side for side, _ in calls] == ["a", "b", "b", "a", "a", "b"]
    starts = [at for i, (_, at) in enumerate(calls) if i % 2 == 0]
    assert all(later - earlier >= 0.2 for earlier, later in itertools.pairwise(starts))


def test_the_stage_trace_times_a_real_servers_stages_in_the_order_a_lone_image_takes_them(tmp_path):
    # bench/stage_trace.py: the tracer loads in the server process (sitecustomize), the client notes its
    # own stages, and the summary orders each stage by its median time from the call's start.
    import json
    import subprocess
    import sys

    from repo_paths import REPO_ROOT

    out = tmp_path / "trace"
    printed = subprocess.run([sys.executable, "bench/stage_trace.py", "run", "--out", str(out), "--model",
                              "tiny-qwen2.5-vl", "--device", "cpu", "--dtype", "float32", "--sizes", "112",
                              "--images", "8", "--gap-s", "0.01"],
                             cwd=REPO_ROOT, check=True, capture_output=True, text=True, timeout=240).stdout
    assert "== 112x112, 3 calls" in printed
    assert len(json.loads((out / "calls.json").read_text())["112"]) == 8
    order = [line.split()[0] for line in printed.splitlines()[1:]]
    wanted = ["c:call>", "intercept>", "Encode>", "prepare>", "prepare<", "enqueue>", "launch>", "wait<",
              "batch_done>", "chunks>", "Encode<", "c:results>", "END"]
    assert [stage for stage in order if stage in wanted] == wanted, printed
    # The summary of the files alone is what the run printed.
    again = subprocess.run([sys.executable, "bench/stage_trace.py", "summary", str(out)], cwd=REPO_ROOT,
                           check=True, capture_output=True, text=True, timeout=120).stdout
    assert again == printed
