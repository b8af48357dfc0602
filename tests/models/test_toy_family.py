"""docs/adding-a-model-family.md, followed literally: a toy family (tests/toy_family/, a package of exactly the
files the page lists for images and video) is added to a copy of the encoder_service package with the one
registry line, a checkpoint of its tiny preset is written with the copy's ``make-checkpoint``, and a real
server from the copy serves it. Two images and a clip through the real client must come back with the toy's
shapes and equal to the toy model's own ``preprocess`` / ``preprocess_video`` + ``encode`` (computed in a
process of the copy: this one imports the repository's package), and GetModelInfo must name the toy.

The repository's tree is never touched: the family exists only in the copy."""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from encoder_client import EncoderClient, Video
from PIL import Image

from encoder_service.benchmarks.reliability.server import EncoderProcess, _wait_serving
from encoder_service.benchmarks.reliability.video_inputs import make_clip

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
TOY_SOURCES = ROOT / "tests" / "toy_family"
PAGE = ROOT / "docs" / "adding-a-model-family.md"
PACKAGE = "toy_vl"
MODEL_TYPE = "toy_vl"
PRESET = "tiny-toy"
HIDDEN = 24  # the preset's text_hidden_size: the tower's output width
MERGE_UNIT = 4  # spatial_merge_size 2
IMAGE_SIZES = ((150, 100), (84, 56))  # (width, height)
CLIP_FRAMES = 4

# Run in a process of the copy: the toy model from the checkpoint, and its own outputs for the same inputs.
REFERENCE = """
import sys, numpy as np
from pathlib import Path
from encoder_service.models import load_vision_model
ckpt, inputs, frames = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
m = load_vision_model(ckpt, device="cpu", dtype="float32")
out = {"model_type": np.array(m.spec.model_type)}
for i in range(2):
    pixels, grid = m.preprocess((inputs / f"image{i}.png").read_bytes())
    (e,) = m.encode(pixels, [grid])
    out[f"image{i}"], out[f"image{i}_grid"] = e.numpy(), np.array(grid)
pixels, grid, used = m.preprocess_video((inputs / "clip.mp4").read_bytes(), num_frames=frames)
(e,) = m.encode(pixels, [grid])
out["clip"], out["clip_grid"], out["clip_used"] = e.numpy(), np.array(grid), np.array(used)
np.savez(inputs / "reference.npz", **out)
"""


def page_files() -> set[str]:
    """The files the page names for a new family ``myfamily`` (images and video), package-relative."""
    return set(re.findall(r"`encoder_service/models/myfamily/(\w+\.py)`", PAGE.read_text()))


def add_family(copy: Path) -> None:
    """The recipe on a copy: the family's package, and its one line in FAMILY_PACKAGES."""
    shutil.copytree(ROOT / "encoder_service", copy / "encoder_service", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(TOY_SOURCES, copy / "encoder_service" / "models" / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__"))
    registry = copy / "encoder_service" / "models" / "registry.py"
    text = registry.read_text()
    head, sep, tail = text.partition("FAMILY_PACKAGES: tuple[str, ...] = (\n")
    assert sep, "registry.py has no FAMILY_PACKAGES tuple to add a line to"
    registry.write_text(f'{head}{sep}    "encoder_service.models.{PACKAGE}",\n{tail}')


def png(seed: int, size: tuple[int, int]) -> bytes:
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def copy_env(copy: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{copy}{os.pathsep}{ROOT / 'client'}"}


def run_copy(copy: Path, *args: str) -> None:
    done = subprocess.run([sys.executable, *args], cwd=copy, env=copy_env(copy), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"


def start_copy_server(copy: Path, *flags: str) -> EncoderProcess:
    """The reliability harness's server process (``start_server``'s command line and wait), run from the copy:
    ``start_server`` itself runs from the repository (cwd and environment fixed), where the toy is unknown."""
    log_path = Path(tempfile.mkstemp(prefix="server-", suffix=".log", dir=copy)[1])
    log_file = open(log_path, "w")  # noqa: SIM115  (closed by EncoderProcess.stop)
    cmd = [sys.executable, "-m", "encoder_service", "serve", "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", "0", "--device", "cpu", "--grace-period-s", "5", *flags]
    proc = subprocess.Popen(cmd, cwd=copy, env=copy_env(copy), stdout=log_file, stderr=subprocess.STDOUT)
    server = EncoderProcess(proc, log_path, _log_file=log_file)
    try:
        _wait_serving(server, 120)
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


def test_the_page_lists_the_toys_files():
    # Images: __init__, preprocess, model, loading (metadata.py only where batches need host arrays of the
    # family's own: the toy's are the shared ones). Video: video.py, and model.py again.
    listed = page_files()
    assert {"__init__.py", "preprocess.py", "model.py", "loading.py", "video.py"} <= listed <= \
        {"__init__.py", "preprocess.py", "model.py", "loading.py", "metadata.py", "video.py"}
    toy = {p.name for p in TOY_SOURCES.glob("*.py")}
    assert toy == listed - {"metadata.py"}


# What the page lets a family import from outside its package: "the shared contract (models/family.py, base.py,
# video_hooks.py, layers.py, loader.py, the ops and attention packages, the shared preprocess/ and metadata.py)
# and the modules of a family it builds on (Qwen3-VL: Qwen2-VL's processing in qwen2_5_vl/preprocess.py,
# processor.py and video.py)"; and errors.py, which the page names for preprocess.py.
PAGE_ALLOWED = ("encoder_service.models.family", "encoder_service.models.base", "encoder_service.models.video_hooks",
                "encoder_service.models.layers", "encoder_service.models.loader", "encoder_service.ops",
                "encoder_service.attention", "encoder_service.preprocess", "encoder_service.metadata",
                "encoder_service.errors", "encoder_service.models.qwen2_5_vl.preprocess",
                "encoder_service.models.qwen2_5_vl.processor", "encoder_service.models.qwen2_5_vl.video")


def outside_imports(path: Path) -> set[str]:
    """The modules a toy file imports from outside the toy package, relative imports resolved as in the copy."""
    package = ["encoder_service", "models", PACKAGE]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names] if base == "encoder_service.models.qwen2_5_vl" else [base]
            found.update(n for n in names if not n.startswith(".".join(package)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found.update(n for n in names if n.split(".")[0] == "encoder_service")
    return found


def test_the_toy_imports_only_what_the_page_allows():
    used = set().union(*(outside_imports(p) for p in TOY_SOURCES.glob("*.py")))
    assert "encoder_service.models.family" in used and "encoder_service.models.qwen2_5_vl.video" in used
    assert sorted(m for m in used if not any(m == a or m.startswith(a + ".") for a in PAGE_ALLOWED)) == []


def test_a_toy_family_from_the_recipe_serves_images_and_clips(tmp_path):
    copy = tmp_path / "copy"
    add_family(copy)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    images = [png(i, size) for i, size in enumerate(IMAGE_SIZES)]
    for i, data in enumerate(images):
        (inputs / f"image{i}.png").write_bytes(data)
    clip = make_clip("mp4", "libx264", frames=12, width=64, height=48, fps=10)
    (inputs / "clip.mp4").write_bytes(clip)

    ckpt = tmp_path / "ckpt"
    run_copy(copy, "-m", "encoder_service", "make-checkpoint", "--preset", PRESET, "--out", str(ckpt))
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == MODEL_TYPE
    # The reference runs while the server starts.
    reference = subprocess.Popen([sys.executable, "-c", REFERENCE, str(ckpt), str(inputs), str(CLIP_FRAMES)],
                                 cwd=copy, env=copy_env(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
    try:
        server = start_copy_server(copy, "--model", str(ckpt), "--max-video-bytes", str(1 << 20))
        try:
            with EncoderClient(server.target, timeout_s=60) as client:
                info = client.model_info()
                got_images = client.encode(images)
                (got_clip,) = client.encode([Video(clip, num_frames=CLIP_FRAMES)])
        finally:
            server.stop()
    finally:
        output, _ = reference.communicate(timeout=120)
    assert reference.returncode == 0, output
    want = np.load(inputs / "reference.npz")

    assert info.model_type == MODEL_TYPE == str(want["model_type"])
    assert info.hidden_size == HIDDEN and info.feature_levels == 1 and info.patch_dim == 3 * 2 * 14 * 14
    assert info.video  # the family takes clips
    for i, got in enumerate(got_images):
        grid = tuple(int(v) for v in want[f"image{i}_grid"])
        tokens = grid[0] * grid[1] * grid[2] // MERGE_UNIT
        assert got.grid_thw == grid and got.num_tokens == tokens and got.hidden_size == HIDDEN
        assert got.embedding.shape == want[f"image{i}"].shape == (tokens, HIDDEN)
        close(got.embedding, want[f"image{i}"])
    assert got_images[0].num_tokens != got_images[1].num_tokens  # two sizes, two token counts
    grid = tuple(int(v) for v in want["clip_grid"])
    assert grid[0] == CLIP_FRAMES // 2  # temporal_patch_size 2
    assert got_clip.grid_thw == grid and got_clip.num_tokens == grid[0] * grid[1] * grid[2] // MERGE_UNIT
    assert list(got_clip.frame_indices) == want["clip_used"].tolist()
    assert got_clip.embedding.shape == want["clip"].shape == (got_clip.num_tokens, HIDDEN)
    close(got_clip.embedding, want["clip"])


def close(got: np.ndarray, want: np.ndarray) -> None:
    """The server batches an input with others and the reference encodes it alone: float32 on the CPU
    agrees to rounding (tests/client_servers.py's bound)."""
    assert float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)) <= 4e-6
