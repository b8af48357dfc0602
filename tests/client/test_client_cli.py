"""The encoder-client command line against the fake VisionEncoder."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from encoder_client.cli import build_parser, main
from encoder_client.protocol import hashing
from encoder_client.testing import (
    FAKE_NAMESPACE,
    Failure,
    FakeVisionEncoder,
    fake_embedding,
    float32_to_bf16_bits,
    serve_fake,
)
from encoder_client.types import SAMPLING_REFERENCES, Video

from encoder_service.preprocess.video_sampling import REFERENCES


@pytest.fixture
def fake() -> FakeVisionEncoder:
    return FakeVisionEncoder()


@pytest.fixture
def target(fake: FakeVisionEncoder) -> Iterator[str]:
    with serve_fake(fake) as t:
        yield t


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    paths = [tmp_path / "a.jpg", tmp_path / "b.png"]
    for i, p in enumerate(paths):
        p.write_bytes(f"image {i}".encode())
    return paths


def test_encode_prints_a_row_per_image_and_writes_npz(
    target: str, files: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "emb.npz"
    assert main(["encode", "--target", target, *map(str, files), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["image", "tokens", "hidden", "hash", "cache", "hit", "ms"]
    hashes = [hashing.hash_encoded(FAKE_NAMESPACE, p.read_bytes()) for p in files]
    for line, path, h in zip(lines[1:3], files, hashes, strict=True):
        cells = line.split()
        assert cells[:5] == [str(path), str(fake_embedding(h).shape[0]), "8", h[:12], "no"]
        assert float(cells[5]) > 0
    with np.load(out) as npz:
        assert sorted(npz.files) == ["hashes", "image_0", "image_1"]
        assert list(npz["hashes"]) == hashes
        np.testing.assert_array_equal(npz["image_1"], fake_embedding(hashes[1]))


def test_encode_out_writes_bf16_as_exact_float32_or_as_bits_and_reads_back_with_plain_numpy(
    target: str, files: list[Path], tmp_path: Path
) -> None:
    # The client returns ml_dtypes.bfloat16 by default; .npy has no bfloat16 (it would read back as
    # 2-byte voids), so --out widens it to float32, exactly; --bf16-as uint16 writes the bits.
    want = float32_to_bf16_bits(fake_embedding(hashing.hash_encoded(FAKE_NAMESPACE, files[0].read_bytes())))
    for bf16_as, dtype, expect in ((None, np.float32, (want.astype(np.uint32) << 16).view(np.float32)),
                                   ("float32", np.float32, (want.astype(np.uint32) << 16).view(np.float32)),
                                   ("uint16", np.uint16, want)):
        out = tmp_path / f"bf16-{bf16_as}.npz"
        flags = [] if bf16_as is None else ["--bf16-as", bf16_as]
        assert main(["encode", "--target", target, str(files[0]), "--dtype", "bfloat16", *flags,
                     "--out", str(out)]) == 0
        with np.load(out) as npz:
            assert npz["image_0"].dtype == dtype
            np.testing.assert_array_equal(npz["image_0"], expect)


def test_encode_repeat_shows_cache_hits_after_the_first_run(
    target: str, files: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["encode", "--target", target, str(files[0]), "--repeat", "3", "--dtype", "bfloat16"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[5]) for r in rows] == [("1", "no"), ("2", "yes"), ("3", "yes")]


def test_encode_of_a_model_with_feature_levels_shows_them_and_writes_each_level(
    files: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "levels.npz"
    with serve_fake(FakeVisionEncoder(feature_levels=3)) as target:
        assert main(["encode", "--target", target, str(files[0]), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["image", "tokens", "hidden", "levels", "hash", "cache", "hit", "ms"]
    assert lines[1].split()[2:4] == ["8", "3"]
    levels = np.split(fake_embedding(hashing.hash_encoded(FAKE_NAMESPACE, files[0].read_bytes()),
                                     feature_levels=3), 3, axis=1)
    with np.load(out) as npz:
        assert sorted(npz.files) == ["hashes", "image_0", "image_0_deepstack_0", "image_0_deepstack_1"]
        for key, level in zip(["image_0", "image_0_deepstack_0", "image_0_deepstack_1"], levels, strict=True):
            np.testing.assert_array_equal(npz[key], level)


def test_info_and_lookup(target: str, files: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--target", target]) == 0
    out = capsys.readouterr().out
    assert f"cache_namespace: {FAKE_NAMESPACE}" in out and "hidden_size: 8" in out
    assert "feature_levels: 1" in out
    assert main(["encode", "--target", target, str(files[0])]) == 0
    h = hashing.hash_encoded(FAKE_NAMESPACE, files[0].read_bytes())
    capsys.readouterr()
    assert main(["lookup", "--target", target, h, "0" * 64]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{h}  cached", f"{'0' * 64}  not cached"]
    assert main(["health", "--target", target]) == 0


def test_failure_exits_non_zero_with_one_line(
    target: str, fake: FakeVisionEncoder, files: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    fake.fail_next.append(Failure(grpc.StatusCode.INVALID_ARGUMENT, "image 0: not an image\n(bad magic)"))
    assert main(["encode", "--target", target, str(files[0])]) == 1
    err = capsys.readouterr().err
    assert err == "encoder-client: error: INVALID_ARGUMENT: image 0: not an image (bad magic)\n"
    assert main(["encode", "--target", target, "/nonexistent.jpg"]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_the_clients_sampling_references_are_the_servers() -> None:
    # The client package never imports the server, so it keeps its own list: this holds it to the server's,
    # in order (the first is the default of both), and the CLI to that list.
    assert SAMPLING_REFERENCES == REFERENCES
    assert Video().reference == hashing.DEFAULT_SAMPLING_REFERENCE == REFERENCES[0]
    parser, encode = build_parser(), ["encode", "--target", "localhost:1", "clip.mp4"]
    assert parser.parse_args(encode).video_reference == REFERENCES[0]
    for reference in REFERENCES:
        assert parser.parse_args([*encode, "--video-reference", reference]).video_reference == reference
    with pytest.raises(SystemExit):
        parser.parse_args([*encode, "--video-reference", "opencv"])


def test_every_video_sampling_setting_can_be_given_from_the_shell(tmp_path: Path) -> None:
    # Each field of the server's VideoSampling is a flag of `encode`, and reaches the Video it sends.
    from encoder_client.cli import _input

    from encoder_service.preprocess.video_sampling import VideoSampling

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\x00" * 16)
    values = {"fps": "2.5", "min_frames": "4", "max_frames": "9", "min_pixels": "3136", "max_pixels": "50176"}
    argv = ["encode", "--target", "localhost:1", str(clip), "--video-reference", "vllm"]
    for name, value in values.items():
        argv += [f"--{name.replace('_', '-')}", value]
    video = _input(clip, build_parser().parse_args(argv))
    for name, value in values.items():
        assert getattr(video, name) == type(getattr(video, name))(value), name
    assert video.reference == "vllm" and video.num_frames is None and not video.all_frames
    every = _input(clip, build_parser().parse_args(["encode", "--target", "localhost:1", str(clip), "--all-frames"]))
    assert every.all_frames and every.to_proto().sampling.all_frames
    counted = _input(clip, build_parser().parse_args(["encode", "--target", "localhost:1", str(clip),
                                                      "--num-frames", "8"]))
    assert counted.num_frames == 8
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["encode"]._actions}
    for field in dataclasses.fields(VideoSampling):
        assert ("video_reference" if field.name == "reference" else field.name) in flags, field.name
