"""The attention blocks context parallelism merges (models/attention_blocks.py), on each device's own kernel: the
CPU's flash kernel, CUDA's memory-efficient one (the ring's kernel on a GPU; untested until a GPU runs this).

The keys of a causal attention cut in two blocks, each block's output and log-sum-exp from `forward`, merged as
the ring merges them (`merge`; here the first block leaves some rows without a key, which the ring's first,
diagonal block never does), equal F.scaled_dot_product_attention over all keys; each block's `backward` given the whole
attention's output and lse gives its part of dq and its keys' dk, dv exactly. With a document mask whose rows
see no key of a block (out 0, lse -inf there). With values of a narrower head dimension than the queries' and
keys' (multi-latent attention; the CPU kernel pads them). fp32 on the CPU (rtol 1e-5, atol 1e-6), bf16 on CUDA (its
kernel's rounding: atol 2e-2).
"""

import pytest
import torch
import torch.nn.functional as F
from cuda_harness import DEVICES, use_device

from megatron_po.models import attention_blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("value_dim", [32, 24], ids=["mha", "mla-values"])  # MLA: values narrower than q/k heads
def test_blocks_merge_into_the_whole_attention(device, documents, value_dim, monkeypatch):
    dev = use_device(device, monkeypatch)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tol = dict(rtol=2e-2, atol=2e-2) if dev.type == "cuda" else dict(rtol=1e-5, atol=1e-6)
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 64, 32
    q, k, v, dout = (torch.randn(b, h, s, d if i < 2 else value_dim, generator=g).to(dev, dtype) for i in range(4))
    allowed = torch.ones(s, s, dtype=torch.bool, device=dev).tril().expand(b, 1, s, s).clone()
    if documents:  # a document starting at 40: its rows see nothing of the first block of keys (0..31) but 40..
        doc = (torch.arange(s, device=dev) >= 40).long()
        allowed &= (doc[:, None] == doc[None, :])
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=allowed)
    ref.backward(dout)
    halves = (slice(0, s // 2), slice(s // 2, s))
    out = lse = None
    for keys in halves:
        o, lb = attention_blocks.forward(q, k[:, :, keys], v[:, :, keys], mask=allowed[..., keys])
        out, lse = (o.float(), lb) if out is None else attention_blocks.merge(out, lse, o, lb)
    torch.testing.assert_close(out.to(dtype), ref.detach(), **tol)
    grads = [attention_blocks.backward(dout, q, k[:, :, keys], v[:, :, keys], out.to(dtype), lse,
                                       mask=allowed[..., keys]) for keys in halves]
    torch.testing.assert_close(grads[0][0] + grads[1][0], q_.grad, **tol)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], dim=2), k_.grad, **tol)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], dim=2), v_.grad, **tol)
