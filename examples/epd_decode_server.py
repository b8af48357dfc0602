"""The decode side of EPD: receive pushed image embeddings and run the LLM on them.

A prefill/decode server that never holds the vision tower. It mounts ``EmbeddingSinkReceiver`` (from
``encoder_client``: no torch needed for that part) on its gRPC server; the encoder service, started
with ``--allowed-sinks <this host:port>``, pushes each request's image embeddings here. The server
then splices them into ``inputs_embeds`` at the image placeholder tokens and runs the language
model of a transformers Qwen2.5-VL or Qwen3-VL checkpoint (the same one the encoder serves). Qwen3-VL's
deepstack levels (``EncodedImage.deepstack``) are added to the hidden states of the LLM's first
layers at the image positions, as the monolithic model does with its own vision tower::

    python examples/epd_decode_server.py --model /ckpt --port 9000
    encoder-service serve --model /ckpt --allowed-sinks 'localhost:9000,127.0.0.1:9000'

A driver (a router, a test) then sends the images to the encoder with
``Sink(target="127.0.0.1:9000", request_id=R)`` and the prompt to this server with the same R.
The prompt's protocol is the example's own: one gRPC method ``/epd.example.Decode/Generate`` whose
request is JSON ``{"request_id", "input_ids", "image_grid_thw", "max_new_tokens", "timeout_s"}`` and
whose response is an ``.npz``: ``prefill_logits`` [seq, vocab] of the prompt, ``step_logits``
[max_new_tokens, vocab] (the logits each greedy token was picked from) and ``tokens``.

Copy ``as_tensor``, ``splice_image_embeddings``, ``deepstack_inputs`` and ``mrope_position_ids``: they are
what a real server needs.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
from collections.abc import Sequence

import grpc
import numpy as np
import torch
from encoder_client import EmbeddingSinkReceiver, EncodedImage

log = logging.getLogger("epd_decode_server")

GENERATE_METHOD = "/epd.example.Decode/Generate"


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A received embedding as a torch tensor, without a copy. bf16 arrives as ``ml_dtypes.bfloat16``
    (the receiver's default ``bf16_as``), which torch.from_numpy does not know: its bits go through
    uint16 and are viewed back as torch.bfloat16."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.asarray(array))


def splice_image_embeddings(model, input_ids: torch.Tensor, images: Sequence[EncodedImage]) -> torch.Tensor:
    """inputs_embeds [1, seq, hidden] of input_ids [1, seq], the image placeholder tokens replaced by
    the images' embeddings in order (image i's num_tokens placeholders get image i's rows)."""
    embed = model.get_input_embeddings()
    inputs_embeds = embed(input_ids)
    positions = (input_ids[0] == model.config.image_token_id).nonzero().flatten()
    rows = torch.cat([as_tensor(im.embedding) for im in images]).to(inputs_embeds.dtype)
    if rows.shape[0] != positions.numel():
        raise ValueError(f"the prompt has {positions.numel()} image placeholders, the images "
                         f"{rows.shape[0]} tokens ({[im.num_tokens for im in images]})")
    inputs_embeds = inputs_embeds.clone()
    inputs_embeds[0, positions] = rows
    return inputs_embeds


def deepstack_inputs(model, input_ids: torch.Tensor, images: Sequence[EncodedImage]
                     ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """Qwen3-VL's deepstack: (visual_pos_masks [1, seq], one [image tokens, hidden] tensor per level),
    level k for LLM layer k, rows in the order of the image placeholders; None for models without."""
    levels = len(images[0].deepstack) if images else 0
    if levels == 0:
        return None
    mask = input_ids == model.config.image_token_id
    dtype = model.get_input_embeddings().weight.dtype
    per_level = [torch.cat([as_tensor(im.deepstack[k]) for im in images]).to(dtype)
                 for k in range(levels)]
    return mask, per_level


def mrope_position_ids(model, input_ids: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
    """Qwen2.5-VL's 3-D rotary positions [3, 1, seq]: they need only the ids and the grids."""
    mm_token_type_ids = (input_ids == model.config.image_token_id).int()
    position_ids, _ = model.model.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw)
    return position_ids


@torch.no_grad()
def greedy_decode(model, input_ids: list[int], image_grid_thw: list[list[int]], images: Sequence[EncodedImage],
                  max_new_tokens: int) -> dict[str, np.ndarray]:
    """Greedy tokens from the prompt with the images' embeddings spliced in (no KV cache: a tiny
    example; a real server would keep one)."""
    ids = torch.tensor([input_ids], dtype=torch.long)
    grids = torch.tensor(image_grid_thw, dtype=torch.long)
    embeds = splice_image_embeddings(model, ids, images)
    deepstack = deepstack_inputs(model, ids, images)
    embed = model.get_input_embeddings()
    step_logits, tokens, prefill_logits = [], [], None
    for _ in range(max_new_tokens):
        position_ids = mrope_position_ids(model, ids, grids)
        if deepstack is None:
            logits = model(inputs_embeds=embeds, position_ids=position_ids).logits[0].float()
        else:
            # Generated tokens are text: the image positions are the prompt's, padded with False.
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[:, :deepstack[0].shape[1]] = deepstack[0]
            hidden = model.model.language_model(inputs_embeds=embeds, position_ids=position_ids,
                                                visual_pos_masks=mask, deepstack_visual_embeds=deepstack[1])
            logits = model.lm_head(hidden.last_hidden_state)[0].float()
        if prefill_logits is None:
            prefill_logits = logits.numpy().copy()
        step_logits.append(logits[-1].numpy().copy())
        token = int(logits[-1].argmax())
        tokens.append(token)
        next_id = torch.tensor([[token]], dtype=torch.long)
        ids = torch.cat([ids, next_id], dim=1)
        embeds = torch.cat([embeds, embed(next_id)], dim=1)
    return {"prefill_logits": prefill_logits, "step_logits": np.stack(step_logits),
            "tokens": np.array(tokens, dtype=np.int64)}


def load_language_model(path: str):
    """The checkpoint's LLM; the vision tower is dropped: here it would be dead weight."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model.model.visual = None
    return model


class DecodeServer:
    def __init__(self, model, receiver: EmbeddingSinkReceiver) -> None:
        self.model = model
        self.receiver = receiver

    async def generate(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        req = json.loads(request)
        try:
            # The prompt may arrive before, during or after the push: wait for this request's images.
            images = await self.receiver.wait(req["request_id"], timeout_s=req.get("timeout_s", 60.0))
        except Exception as exc:  # whatever it was, the driver should hear it
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"embeddings for {req['request_id']}: {exc}")
        out = await asyncio.to_thread(greedy_decode, self.model, req["input_ids"], req["image_grid_thw"],
                                      images, int(req.get("max_new_tokens", 1)))
        buf = io.BytesIO()
        np.savez(buf, **out)
        return buf.getvalue()

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.unary_unary_rpc_method_handler(self.generate)
        return grpc.method_handlers_generic_handler("epd.example.Decode", {"Generate": method})


async def serve(model_path: str, host: str, port: int, max_buffered_bytes: int) -> None:
    model = await asyncio.to_thread(load_language_model, model_path)
    receiver = EmbeddingSinkReceiver(max_buffered_bytes=max_buffered_bytes, request_timeout_s=120)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)])
    receiver.add_to_server(server)
    server.add_generic_rpc_handlers((DecodeServer(model, receiver).handler(),))
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"decode server listening on {host}:{bound}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="transformers Qwen2.5-VL checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000, help="0 picks a free port (printed)")
    parser.add_argument("--max-buffered-bytes", type=int, default=1 << 30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    asyncio.run(serve(args.model, args.host, args.port, args.max_buffered_bytes))


if __name__ == "__main__":
    main()
