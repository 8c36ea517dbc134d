"""The ring's block kernel on CUDA (PyTorch's memory-efficient attention) against the fp32 matmul blocks, forward and
backward, plain, causal and document-masked (rows that see no key among them), at lengths that are not multiples of
the kernel's 32-row log-sum-exp padding or 16-element bias alignment. CPU runs check the glue through stand-ins
(``tests/distributed/test_context_parallel.py``); this checks the kernel itself."""

import math

import pytest
import torch

from trickles.parallel.ring_blocks import BlockMask, CudaEfficient, Matmul, kernel_for


def _case(c: int, dtype, masked: bool, causal: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, h, d = 2, 4, 64
    q, k, v, do = (torch.randn(b, h, c, d, device="cuda", generator=g).to(dtype) for _ in range(4))
    mask = None
    if masked:  # row 0: two documents, split a third of the way; row 1: queries of one document, keys of another
        ids = torch.zeros(b, c, dtype=torch.long, device="cuda")
        ids[0, c // 3 :] = 1
        keys = ids.clone()
        keys[1, :] = 1  # (no query of row 1 sees a key)
        m = ids[:, None, :, None] == keys[:, None, None, :]
        mask = BlockMask(m & torch.ones(c, c, dtype=torch.bool, device="cuda").tril() if causal else m)
        causal = False  # (the mask carries the triangle, as the ring builds it)
    return q, k, v, do, mask, causal


@pytest.mark.needs_gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(
    "c,masked,causal", [(128, False, True), (48, False, False), (40, True, True), (72, True, False)]
)
def test_cuda_block_kernel_equals_the_matmul_blocks(dtype, tol, c, masked, causal):
    q, k, v, do, mask, causal = _case(c, dtype, masked, causal)
    kernel = kernel_for(q)
    assert isinstance(kernel, CudaEfficient)
    scale = 1.0 / math.sqrt(q.shape[-1])
    o, lse = kernel.forward(q, k, v, scale, causal, mask)
    o_ref, lse_ref = Matmul.forward(q.float(), k.float(), v.float(), scale, causal, mask)
    seen = torch.isfinite(lse_ref)
    assert torch.equal(seen, torch.isfinite(lse)) and float((lse - lse_ref)[seen].abs().max()) < tol
    assert float((o - o_ref).abs().max()) < tol * max(1.0, float(o_ref.abs().max()))
    # backward as the ring calls it: one block is the whole softmax here, so the final output and lse are the block's
    # (a row that sees no key has a finite lse in the ring, from its other blocks: 0 here)
    out, lse_final = o_ref.to(dtype), torch.where(seen, lse_ref, torch.zeros_like(lse_ref))
    delta = (do.float() * out.float()).sum(-1)
    grads = kernel.backward(q, k, v, do, out, lse_final, delta, scale, causal, mask)
    refs = Matmul.backward(q, k, v, do, out, lse_final, delta, scale, causal, mask)
    for got, want in zip(grads, refs):
        assert float((got - want).abs().max()) < tol * max(1.0, float(want.abs().max())), (got - want).abs().max()
