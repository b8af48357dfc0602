"""A backend whose kernel runs at a wider head_dim (``padded_head_dim``, as FlashInfer's FA3 pads 72 to
128) gets q, k, v already zero-padded from the tower's compiled rotary and hands back padded heads,
which the output projection drops: the embedding is the one of unpadded attention."""

import torch
import torch.nn.functional as F
from qwen3_vl_tiny import ours, pixels, rel_err

from encoder_service.attention.sdpa import SDPABackend

HEAD_DIM = 72  # the tiny tower's, as the real one's


class PaddedSDPA(SDPABackend):
    """SDPA at head_dim 128 on heads the model must hand over padded, with the true head_dim's scale."""

    padded_head_dim = 128
    calls = 0

    def forward_ragged(self, q, k, v, prepared):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] == self.padded_head_dim, q.shape
        # The padding is zeros: nothing of it may reach q.k or the output.
        assert not q[..., HEAD_DIM:].any() and not k[..., HEAD_DIM:].any() and not v[..., HEAD_DIM:].any()
        type(self).calls += 1
        out = torch.empty_like(q)
        for start, end in prepared:
            qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=self.scale).transpose(0, 1)
        return out


def test_heads_padded_for_the_backend_give_the_unpadded_embedding():
    plain = ours("qwen3_vl")
    padded = ours("qwen3_vl")
    padded.backend = PaddedSDPA(plain.cfg.num_heads, HEAD_DIM, torch.device("cpu"), torch.float32)
    assert padded.cfg.head_dim == HEAD_DIM
    # Sequences of several lengths (the ragged path) and of one length (the dense batched path).
    for grids in ([[1, 16, 16], [1, 4, 6], [2, 12, 8]], [[1, 8, 8], [1, 8, 8]]):
        x = pixels(grids, plain.patch_dim)
        for a, b in zip(padded.encode(x, grids), plain.encode(x, grids), strict=True):
            assert rel_err(a, b) <= 1e-6
    assert PaddedSDPA.calls >= plain.cfg.depth  # every block attended through the padded kernel
