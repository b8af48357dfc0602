"""How large an item may be, and a clip larger than one forward: cut into parts of whole time steps
(``ModelSpec.split_unit``: steps that attend only within themselves, so the parts' rows concatenated
equal one forward's), one WorkItem each, their embeddings gathered by the job's ``ClipParts``
(engine/jobs.py). Lives on the event loop, beside engine.py, which calls it."""

from __future__ import annotations

from ..config import BatchingConfig, VideoConfig
from ..errors import ResourceExhausted
from ..modality import Modality
from ..models.base import ModelFront
from ..preprocess.staged import clip_part
from .batch_queue import WorkItem
from .jobs import Job
from .types import Grid


def check_size(front: ModelFront, batching: BatchingConfig, video: VideoConfig, grid: Grid,
               modality: Modality = "image") -> None:
    """RESOURCE_EXHAUSTED where an image is over one forward, or a clip (``modality`` "video") over
    --max-video-patches or with a single step over one forward; a larger clip is cut (``work_items``).
    Two groups: one forward's size is batching's, a clip's whole size video's."""
    n = front.num_patches(grid)
    if modality == "video" and n > video.max_patches:
        raise ResourceExhausted(
            f"clip has {n} patches (grid {list(grid)}), more than --max-video-patches "
            f"{video.max_patches} allows; sample fewer or smaller frames")
    if modality == "video" and (unit := front.spec.split_unit) and grid[0] > 1:
        t, h, w = grid
        if (part := min(unit, t) * h * w) <= batching.max_batch_tokens:
            return
        raise ResourceExhausted(
            f"clip has {n} patches (grid {list(grid)}); even its smallest part ({min(unit, t)} of its {t} "
            f"time steps, {part} patches) is more than --max-batch-tokens {batching.max_batch_tokens} "
            "allows in one forward pass; sample smaller frames")
    if n > batching.max_batch_tokens:
        noun, advice = (("image", "send a smaller image") if modality == "image"
                        else ("clip", "sample fewer or smaller frames"))
        raise ResourceExhausted(
            f"{noun} has {n} patches (grid {list(grid)}), more than --max-batch-tokens "
            f"{batching.max_batch_tokens} allows in one forward pass; {advice}")


def work_items(job: Job, front: ModelFront, budget: int) -> list[WorkItem]:
    """The job's forward work: one item, or a clip larger than one forward cut into parts of whole
    ``spec.split_unit`` steps (exact: those steps encode independently), each as large as fits."""
    if front.num_patches(job.grid) <= budget:
        return [WorkItem(job.payload, job.grid, job)]
    spec = front.spec
    t, h, w = job.grid
    steps = budget // (h * w * spec.split_unit) * spec.split_unit  # check_size: at least one unit
    return [WorkItem(clip_part(job.payload, start, min(start + steps, t), spec.temporal_patch_size, spec.patch_dim),
                     (min(start + steps, t) - start, h, w), job, part=n)
            for n, start in enumerate(range(0, t, steps))]

