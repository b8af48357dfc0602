"""``--devices``: which devices get a worker process, and what each worker may see."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import OnWorkers, Placement, check_devices, device_entries


@dataclass(frozen=True)
class WorkerDevice:
    """One entry of ``--devices``: the device the worker reports (``label``, e.g. cuda:1), the
    device its model uses inside its process, and the CUDA_VISIBLE_DEVICES it gets (None: keep)."""

    label: str
    device: str
    visible: str | None

    @classmethod
    def parse(cls, entry: str, position: int = 0) -> WorkerDevice:
        entry = entry.strip()
        if entry == "cpu":  # CPU workers are told apart by their place in --devices
            return cls(f"cpu:{position}", "cpu", None)
        index = entry.removeprefix("cuda:")
        if not index.isdigit():
            raise ValueError(f"--devices entry {entry!r} is neither cpu nor a GPU index (0, 1 or cuda:1)")
        parent = os.environ.get("CUDA_VISIBLE_DEVICES")
        # Indices count the GPUs this process may see, as torch's do.
        visible = index if parent is None else _nth_visible(parent, int(index))
        return cls(f"cuda:{index}", "cuda:0", visible)


def parse_devices(spec: str) -> list[WorkerDevice]:
    """``--devices``: ``0,1``, ``cuda:0,cuda:1``, ``cpu,cpu`` or ``all`` (every GPU this process
    may see, counted through NVML: asking the CUDA runtime would initialise it here)."""
    if spec.strip() == "all":
        import torch

        count = torch.cuda._device_count_nvml()
        if count <= 0:
            raise ValueError("--devices all: no GPU visible (NVML found none)")
        entries = [str(i) for i in range(count)]
    else:
        problems = check_devices(spec)
        if problems:
            raise ValueError(problems[0])
        entries = device_entries(spec)
    if not entries:
        raise ValueError(f"--devices {spec!r} names no device")
    return [WorkerDevice.parse(e, i) for i, e in enumerate(entries)]


def gpu_indices(placement: Placement) -> tuple[int, ...]:
    """The GPUs this node serves, as this process counts them (``--devices``, else ``--device``)."""
    if isinstance(placement, OnWorkers):
        if placement.devices.strip() == "all":
            return tuple(range(len(parse_devices(placement.devices))))
        return tuple(int(e.removeprefix("cuda:")) for e in device_entries(placement.devices) if e != "cpu")
    device = placement.device
    return (int(device.partition(":")[2] or 0),) if device.startswith("cuda") else ()


def _nth_visible(visible: str, index: int) -> str:
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise ValueError(f"--devices names GPU {index}, but CUDA_VISIBLE_DEVICES={visible!r} shows "
                         f"{len(entries)} GPU(s)")
    return entries[index]
