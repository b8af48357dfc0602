"""Decoding the sampled frames of an H.264 clip without decoding the frames nothing refers to.

A 2 fps sample of a 30 fps clip keeps one frame in fifteen, but every reference frame between two
samples must still be decoded, since later frames are predicted from it. A non-reference frame (most
B-frames of an encoder's default output) is needed by nothing but itself: one that is not sampled can be
skipped (FFmpeg's ``skip_frame = NONREF``, set packet by packet: the sampled ones are decoded as usual).
On B-frame content this saved about a third of the decode CPU (bench/RESULTS.md); on streams without
B-frames every frame is a reference and nothing changes.

Frames are numbered as the reference numbers them (read_video_pyav and vLLM's loader count the frames
the decoder outputs, in presentation order). Skipped frames come out of nowhere, so here a frame's
number is the rank of its pts among the stream's packets, read first without decoding (packets FFmpeg
discards, an edit list's pre-roll, are not counted: their frames never come out). That equals the
reference's count for every stream whose packets each give one frame with a distinct pts. Anything else
raises ``Fallback`` and the caller decodes every frame instead: a packet without a pts, two packets
with one pts, a frame whose pts no packet had, a sampled frame that never came, any decoder error (so
that the full decode reports it as the reference would).

Only H.264: its non-reference flag (``nal_ref_idc == 0``) means no later frame reads the picture. In
H.265 a sub-layer non-reference picture may still be read by a higher temporal sub-layer, and VP9 and
AV1 have no such per-frame skip in FFmpeg.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

CODECS = frozenset({"h264"})


class Fallback(Exception):
    """This stream cannot be numbered by pts here: decode every frame."""


def _ranks(container, stream) -> dict[int, int]:
    container.seek(0)  # as the reference does before it decodes
    pts = []
    for packet in container.demux(stream):
        if packet.size == 0 or packet.is_discard:
            continue
        if packet.pts is None:
            raise Fallback
        pts.append(packet.pts)
    ranks = {p: r for r, p in enumerate(sorted(pts))}
    if len(ranks) != len(pts):
        raise Fallback
    return ranks


def decode(container, stream, frames, check: Callable[[object, int], None]) -> np.ndarray:
    """The frames ``frames.rows`` asks for (``video_decode.WantedFrames``, filled and returned),
    ``check(frame, number)`` applied to every frame that comes out. Raises Fallback (above)."""
    import av.error

    try:
        ranks = _ranks(container, stream)
        if frames.last >= len(ranks):
            raise Fallback  # the full decode says how many frames there are, as the reference does
        context = stream.codec_context
        container.seek(0)
        for packet in container.demux(stream):
            if packet.size:
                # Only the frames wanted are decoded whatever they are; reference frames always are.
                context.skip_frame = "DEFAULT" if ranks.get(packet.pts) in frames.rows else "NONREF"
            for frame in context.decode(packet):
                number = ranks.get(frame.pts)
                if number is None:
                    raise Fallback
                check(frame, number)
                if number in frames.rows:
                    frames.put(number, frame)
            if frames.complete:
                break
    except av.error.FFmpegError:
        raise Fallback from None
    if not frames.complete:
        raise Fallback
    return frames.out
