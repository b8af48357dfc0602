"""Decoding the sampled frames of an H.264 clip without decoding the frames nothing refers to.

A 2 fps sample of a 30 fps clip keeps one frame in fifteen, but every reference frame between two
samples must still be decoded, since later frames are predicted from it. A non-reference frame (most
B-frames of an encoder's default output) is needed by nothing but itself: one that is not sampled can be
skipped (FFmpeg's ``skip_frame = NONREF``, set packet by packet: the sampled ones are decoded as usual).
On calm B-frame content this saved a third to a half of the decode CPU (bench/RESULTS.md); on streams without
B-frames every frame is a reference and nothing changes.

Frames are numbered as the reference numbers them (read_video_pyav and vLLM's loader count the frames
the decoder outputs, in presentation order). Skipped frames never come out, so here a frame's number is
the rank of its pts among the stream's packets, read first without decoding (packets FFmpeg discards, an
edit list's pre-roll, are not counted: their frames never come out). That equals the reference's count
only where every other packet gives one frame, in pts order; so this path is taken, and kept, only
where that can be seen to hold, and raises ``Fallback`` (the caller then decodes every frame) otherwise:
- the stream starts with an IDR picture (a clip cut inside an open GOP, or starting on a P-frame, has
  leading frames the decoder drops; an IDR has none);
- every packet has a pts, no two the same, and its NAL units parse (length-prefixed, as MP4 and
  Matroska store H.264);
- the frames come out in strictly increasing number, and every number passed over belongs to a packet
  whose pictures are all non-reference (``nal_ref_idc`` 0) and not wanted: one this path skipped, not
  one the decoder dropped;
- every wanted frame came, and the decoder raised nothing (the full decode then reports the error as
  the reference would).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

CODECS = frozenset({"h264"})


class Fallback(Exception):
    """This stream cannot be numbered by pts here: decode every frame."""


def _nal_length_size(extradata: bytes | None) -> int:
    """The NAL length prefix size of an avcC record (MP4, Matroska); Fallback for Annex B or none."""
    if not extradata or len(extradata) < 7 or extradata[0] != 1:
        raise Fallback
    return (extradata[4] & 3) + 1


def _pictures(data: memoryview, length_size: int) -> tuple[bool, bool]:
    """(holds an IDR slice, every slice is non-reference) of one packet's NAL units."""
    idr, nonref, slices, at = False, True, 0, 0
    while at < len(data):
        if at + length_size > len(data):
            raise Fallback
        size = int.from_bytes(data[at:at + length_size], "big")
        at += length_size
        if size < 1 or at + size > len(data):
            raise Fallback
        header = data[at]
        kind, ref_idc = header & 0x1F, (header >> 5) & 3
        if kind in (1, 5):  # a coded slice: non-IDR, IDR
            slices += 1
            idr |= kind == 5
            nonref &= ref_idc == 0
        at += size
    return idr, nonref and slices > 0


def _scan(container, stream, tick: Callable[[], None]) -> tuple[dict[int, int], set[int]]:
    """(pts -> frame number, the pts of packets whose pictures are all non-reference); Fallback where
    the stream is not one this path can number (the module's docstring)."""
    length_size = _nal_length_size(stream.codec_context.extradata)
    container.seek(0)  # as the reference does before it decodes
    pts, nonref = [], set()
    first = True
    for count, packet in enumerate(container.demux(stream)):
        if packet.size == 0:
            continue
        if count % 64 == 0:
            tick()
        idr, all_nonref = _pictures(memoryview(packet), length_size)
        if first and not idr:
            raise Fallback
        first = False
        if packet.is_discard:
            continue
        if packet.pts is None:
            raise Fallback
        pts.append(packet.pts)
        if all_nonref:
            nonref.add(packet.pts)
    ranks = {p: r for r, p in enumerate(sorted(pts))}
    if len(ranks) != len(pts):
        raise Fallback
    return ranks, nonref


def decode(container, stream, frames, check: Callable[[object, int], None], tick: Callable[[], None]
           ) -> np.ndarray:
    """The frames ``frames.rows`` asks for (``video_decode.WantedFrames``, filled and returned),
    ``check(frame, number)`` applied to every frame that comes out, ``tick()`` (the time limit) as the
    packets are read. Raises Fallback (the module's docstring)."""
    import av.error

    try:
        ranks, nonref = _scan(container, stream, tick)
        if frames.last >= len(ranks):
            raise Fallback  # the full decode says how many frames there are, as the reference does
        skippable = {p for p in nonref if ranks[p] not in frames.rows}
        by_rank = {r: p for p, r in ranks.items()}
        context = stream.codec_context
        container.seek(0)
        last = -1
        for packet in container.demux(stream):
            if packet.size:
                # Only the pictures nothing refers to and nobody wants are skipped.
                context.skip_frame = "NONREF" if packet.pts in skippable else "DEFAULT"
            for frame in context.decode(packet):
                number = ranks.get(frame.pts)
                if number is None or number <= last:
                    raise Fallback
                if any(by_rank[n] not in skippable for n in range(last + 1, number)):
                    raise Fallback  # a frame that should have come did not: the decoder dropped it
                last = number
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
