"""One image's embedding -> EmbeddingChunk messages of whole rows, each within the byte budget."""

from __future__ import annotations

from collections.abc import Iterator

from encoder_client._proto.encoder.v1 import encoder_pb2

from ..engine import ImageResult
from ..engine.convert import output_dtype as torch_output_dtype
from ..engine.convert import rows_to_bytes
from . import dtypes


def embedding_chunks(result: ImageResult, *, request_id: str, out_dtype: str | None, model_dtype: str,
                     max_chunk_bytes: int) -> Iterator[encoder_pb2.EmbeddingChunk]:
    name = out_dtype or model_dtype
    torch_dtype = torch_output_dtype(name, result.embedding.dtype)
    num_tokens, hidden = result.num_tokens, result.hidden_size
    row_bytes = hidden * dtypes.ITEMSIZE[name]
    rows_per_chunk = max(1, max_chunk_bytes // max(1, row_bytes))  # at least one row, whatever the budget
    start = 0
    while True:
        stop = min(num_tokens, start + rows_per_chunk)
        last = stop >= num_tokens
        chunk = encoder_pb2.EmbeddingChunk(
            request_id=request_id, image_index=result.index, content_hash=result.content_hash,
            grid_thw=list(result.grid), num_tokens=num_tokens, hidden_size=hidden,
            dtype=dtypes.ENUM_BY_NAME[name], token_offset=start,
            data=rows_to_bytes(result.embedding, torch_dtype, start, stop), last=last,
            cache_hit=result.cache_hit)
        if last:
            t = result.timing
            chunk.timing.CopyFrom(encoder_pb2.ServerTiming(
                queue_ms=t.queue_ms, preprocess_ms=t.preprocess_ms, forward_ms=t.forward_ms))
        yield chunk
        if last:
            return
        start = stop
