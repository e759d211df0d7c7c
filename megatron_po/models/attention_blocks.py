"""Attention of one block of queries against one block of keys, with its log-sum-exp: the unit that
context-parallel attention (context_parallel_attention.py) runs per key/value block and merges.

    forward(q, k, v, causal, mask)                  -> out [b, h, sq, d], lse [b, h, sq] (fp32)
    backward(dout, q, k, v, out, lse, causal, mask) -> dq, dk, dv

`out`/`lse` given to the backward are those of the whole attention (every block merged), as flash
attention's backward takes them: P = exp(QKᵀ·scale − lse) is then this block's share of the full softmax,
D = rowsum(dout ⊙ out) is the full row's, and the block's dq, dk, dv are its exact part of the gradient.
`causal`: the top-left causal mask (query i sees keys j <= i; used where sq == sk). `mask`: bool
[b or 1, 1, sq, sk], True = may attend (document masks); the rows it masks entirely get out = 0 and
lse = −inf, so merging them adds nothing.

Kernels, PyTorch's own: on a CPU `_scaled_dot_product_flash_attention_for_cpu` and its backward (the
kernel F.scaled_dot_product_attention runs there; it returns lse = 0 for an entirely masked row, which is
corrected here); on CUDA the memory-efficient kernel (`_scaled_dot_product_efficient_attention`, which
takes a mask); `math=True` (--attention-backend local/unfused, or any other device): the explicit
softmax(QKᵀ)V in fp32. Keys and values must have the queries' heads (the caller repeats GQA groups); the
values' head dimension may differ from the queries' and keys' (multi-latent attention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _empty_rows(mask: torch.Tensor | None) -> torch.Tensor | None:
    """[b or 1, 1, sq] True where the mask lets a query see no key of this block."""
    return None if mask is None else ~mask.any(dim=-1)


def _causal(sq: int, sk: int, device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


# --------------------------------------------------------------------------------------------------
# Explicit softmax(QKᵀ)V (fp32), any device
# --------------------------------------------------------------------------------------------------


def _math_probabilities(q, k, causal, mask, lse=None):
    """(P, lse): the block's softmax weights against `lse` (its own when None), masked entries 0."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    allowed = _causal(q.shape[2], k.shape[2], q.device) if causal else None
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)[..., None]
    probs = torch.where(finite, torch.exp(scores - torch.where(finite, lse[..., None], 0.0)), 0.0)
    return probs, lse


def _math_forward(q, k, v, causal, mask):
    probs, lse = _math_probabilities(q, k, causal, mask)
    return torch.matmul(probs, v.float()).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, mask):
    probs, _ = _math_probabilities(q, k, causal, mask, lse)
    dout32 = dout.float()
    dv = torch.matmul(probs.transpose(-1, -2), dout32)
    dprobs = torch.matmul(dout32, v.float().transpose(-1, -2))
    row = (dout32 * out.float()).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - row) * (1.0 / math.sqrt(q.shape[-1]))
    dq = torch.matmul(dscores, k.float())
    dk = torch.matmul(dscores.transpose(-1, -2), q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------------------
# PyTorch's fused kernels
# --------------------------------------------------------------------------------------------------


def _one_head_dim(*tensors, d: int):
    """The CPU kernel takes one head dimension for queries, keys and values: the narrower ones padded with zeros
    to `d` (zero query/key columns add nothing to the scores, zero value columns give zero outputs)."""
    return [t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1])) for t in tensors]


def _cpu_forward(q, k, v, causal, mask):
    d, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(*_one_head_dim(q, k, v, d=d), 0.0, causal,
                                                                attn_mask=_additive(mask, q.dtype), scale=scale)
    return out[..., :dv], lse


def _cpu_backward(dout, q, k, v, out, lse, causal, mask):
    # The kernel reads lse only through exp(scores - lse): an entirely masked row (lse = -inf here, every
    # score -inf) must not become exp(nan); any finite value gives the row its zero gradient.
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    d, dqk, dv = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_one_head_dim(dout, q, k, v, out, d=d), lse, 0.0, causal, attn_mask=_additive(mask, q.dtype),
        scale=1.0 / math.sqrt(dqk))
    return grads[0][..., :dqk], grads[1][..., :dqk], grads[2][..., :dv]


_ALIGN = 16  # the memory-efficient kernel reads its bias in rows padded to this many elements


def _cuda_bias(mask, q, k):
    """The mask as the efficient kernel's additive bias: [b, h, sq, sk], rows padded to _ALIGN (as
    F.scaled_dot_product_attention pads it)."""
    if mask is None:
        return None
    b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    padded = torch.zeros(*mask.shape[:-1], (sk + _ALIGN - 1) // _ALIGN * _ALIGN, dtype=q.dtype, device=q.device)
    padded[..., :sk].masked_fill_(~mask, float("-inf"))
    return padded[..., :sk].expand(b, h, sq, sk)


def _cuda_forward(q, k, v, causal, mask):
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, _cuda_bias(mask, q, k), True, 0.0, causal)
    return out, lse[..., :q.shape[2]].float()  # the kernel pads lse's last dim (to 32)


def _cuda_backward(dout, q, k, v, out, lse, causal, mask):
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    pad = (q.shape[2] + 31) // 32 * 32 - q.shape[2]
    lse = F.pad(lse, (0, pad)).contiguous()
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed and offset: no dropout here
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, k, v, _cuda_bias(mask, q, k), out, lse, unused, unused, 0.0,
        [True, True, True, False], causal)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------------


def _kernels(device: torch.device, math_kernel: bool):
    if math_kernel or device.type not in ("cpu", "cuda"):
        return _math_forward, _math_backward
    return (_cpu_forward, _cpu_backward) if device.type == "cpu" else (_cuda_forward, _cuda_backward)


def forward(q, k, v, causal: bool = False, mask: torch.Tensor | None = None, math_kernel: bool = False):
    """(out, lse fp32) of softmax(QKᵀ/√d)V over this block (module docstring)."""
    run, _ = _kernels(q.device, math_kernel)
    out, lse = run(q, k, v, causal, mask)
    empty = _empty_rows(mask)
    if empty is not None:  # fused kernels give such rows lse = 0 (their out is 0 already)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse.float()


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """(out, lse) of the attention over the keys of (out, lse) and of a further block (block_out, block_lse), fp32:
    lse' = log(e^lse + e^lse_b), out' = out + e^(lse_b - lse')·(out_b − out), the softmax-weighted sum in a form
    that stays finite (a row that has seen no key yet: lse = −inf, out = 0)."""
    merged = torch.logaddexp(lse, block_lse)
    weight = torch.where(torch.isfinite(merged), torch.exp(block_lse - merged), 0.0)[..., None]
    return out + weight * (block_out.float() - out), merged


def backward(dout, q, k, v, out, lse, causal: bool = False, mask: torch.Tensor | None = None,
             math_kernel: bool = False):
    """(dq, dk, dv) of this block, given the output and lse of the whole attention (module docstring)."""
    _, run = _kernels(q.device, math_kernel)
    return run(dout, q, k, v, out, lse.to(torch.float32), causal, mask)
