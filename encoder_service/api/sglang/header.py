"""The first ZMQ frame SGLang's receivers expect: a pickled ``EmbeddingData`` (without its tensor).

SGLang's encoder sends ``pickle.dumps(mm_data.copy_without_embedding())`` then the embedding's
raw bytes; its receivers (``sglang.srt.disaggregation.encoder.receiver``) load the first frame with
``safe_pickle_loads``, whose allowlist admits ``EmbeddingData``, ``Modality`` and torch dtypes, and
read the second with ``torch.frombuffer(frame, dtype=header.dtype).reshape(header.shape)``.

This process has neither SGLang nor (in the API layer) torch to pickle those objects, so the
frame is written opcode by opcode (pickle protocol 2): the same classes, looked up by the same
module and name, and the same instance attributes as SGLang's ``copy_without_embedding()``. The
grid is a list of ``[t, h, w]`` lists (SGLang's receiver turns it into a tensor with
``torch.as_tensor``). Extra keyword attributes are set on the instance as ``EmbeddingData(**kwargs)``
does; receivers ignore the ones they do not know.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.multimodal.modality", "Modality")
MODALITY_IMAGE = 1  # Modality.IMAGE = auto()
TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


class _Global:
    """A module attribute, pickled by name (GLOBAL): a class, or a torch dtype."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class _Reduce:
    """``callable(*args)`` when unpickled: how an Enum member pickles (``Modality(1)``)."""

    def __init__(self, func: _Global, args: tuple) -> None:
        self.func, self.args = func, args


def _write(out: bytearray, value: object) -> None:
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"\x88" if value else b"\x89"
    elif isinstance(value, int):
        if -(1 << 31) <= value < (1 << 31):
            out += b"J" + struct.pack("<i", value)
        else:
            raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            out += b"\x8a" + bytes([len(raw)]) + raw
    elif isinstance(value, float):
        out += b"G" + struct.pack(">d", value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"X" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, (list, tuple)):
        out += b"]" if isinstance(value, list) else b"("
        if isinstance(value, list):
            if value:
                out += b"("
                for item in value:
                    _write(out, item)
                out += b"e"
        else:
            for item in value:
                _write(out, item)
            out += b"t"
    elif isinstance(value, dict):
        out += b"}"
        if value:
            out += b"("
            for key, item in value.items():
                _write(out, key)
                _write(out, item)
            out += b"u"
    elif isinstance(value, _Global):
        out += b"c" + value.module.encode() + b"\n" + value.name.encode() + b"\n"
    elif isinstance(value, _Reduce):
        _write(out, value.func)
        _write(out, value.args)
        out += b"R"
    else:
        raise TypeError(f"cannot write {type(value).__name__} into an EmbeddingData header")


def embedding_data_header(req_id: str, num_parts: int, part_idx: int, grids: Sequence[Sequence[int]],
                          num_tokens: int, row_width: int, dtype: str, **extra: object) -> bytes:
    """The pickled ``EmbeddingData`` of one part: ``shape`` [num_tokens, row_width] in ``dtype``
    (float32, float16 or bfloat16: a torch dtype's name)."""
    state = {
        "req_id": req_id, "num_parts": num_parts, "part_idx": part_idx,
        "grid_dim": [[int(x) for x in g] for g in grids],
        "modality": _Reduce(_Global(*MODALITY), (MODALITY_IMAGE,)),
        "embedding": None, "send_time": None,
        "dtype": _Global("torch", TORCH_DTYPES[dtype]),
        "shape": [num_tokens, row_width],
        "_mr_ptr": None, "error_msg": None, "error_code": None,
        **extra,
    }
    out = bytearray(b"\x80\x02")  # PROTO 2
    _write(out, _Global(*EMBEDDING_DATA))
    out += b")\x81"  # EMPTY_TUPLE, NEWOBJ: EmbeddingData.__new__(EmbeddingData)
    _write(out, state)
    out += b"b."  # BUILD (instance __dict__ update), STOP
    return bytes(out)
