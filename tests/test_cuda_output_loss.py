"""The chunked output layer + cross entropy (tensor_parallel/output_cross_entropy.py) on the device, at the shapes
of a real vocabulary: bf16 weights and input, 1,024 tokens x hidden 256 x vocab 50,304 in 6 chunks, the gradients
computed in the forward (the loss's gradient a multiple of the loss mask) and, on a GPU, the weight gradient
accumulated by GEMMs with an fp32 output (`torch.addmm(out_dtype=)`, where the device's torch has it).

Each path is compared with the exact gradients (fp32 arithmetic on the same bf16 values, on the same device):
within bf16's resolution (2^-7 of the largest entry), as the unfused path (the [tokens x V] logits, then the
vocab-parallel cross entropy) is; losses within 1e-3 of the exact ones (bf16 logits either way).
"""

import pytest
import torch
from cuda_harness import DEVICES, use_device

from megatron_po.tensor_parallel import ColumnParallelLinear, output_cross_entropy, vocab_parallel_cross_entropy

TOKENS, HIDDEN, VOCAB = 1024, 256, 50304


def losses_and_grads(layer, x, target, mask, chunked):
    x = x.detach().clone().requires_grad_()
    layer.weight.grad = None
    if chunked:
        loss = output_cross_entropy.output_layer_cross_entropy(layer, x, target, loss_weight=mask)
    else:
        loss = vocab_parallel_cross_entropy(layer(x)[0].float(), target)
    ((loss * mask).sum() / mask.sum()).backward()
    return loss.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_bf16_loss_on_the_device_within_bf16_of_the_exact_gradients(device, monkeypatch):
    on = use_device(device, monkeypatch)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS // 4, 4, HIDDEN, generator=g).to(on, torch.bfloat16)
    target = torch.randint(0, VOCAB, (TOKENS // 4, 4), generator=g).to(on)
    mask = (torch.rand(TOKENS // 4, 4, generator=g) > 0.1).float().to(on)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(HIDDEN, VOCAB, bias=False).to(on, torch.bfloat16)
    recomputed = []
    grads = output_cross_entropy._grads
    monkeypatch.setattr(output_cross_entropy, "_grads", lambda *a, **k: recomputed.append(1) or grads(*a, **k))
    chunked = losses_and_grads(layer, x, target, mask, chunked=True)
    assert recomputed == []  # the forward's gradients, scaled
    unfused = losses_and_grads(layer, x, target, mask, chunked=False)
    exact_layer = ColumnParallelLinear(HIDDEN, VOCAB, bias=False).to(on)
    with torch.no_grad():
        exact_layer.weight.copy_(layer.weight.float())
    exact = losses_and_grads(exact_layer, x.float(), target, mask, chunked=False)
    for path in (chunked, unfused):
        assert (path[0] - exact[0]).abs().max() <= 1e-3 * exact[0].abs().max()
        for got, reference, what in zip(path[1:], exact[1:], ("input grad", "weight grad")):
            assert got.dtype == torch.bfloat16 and got.device.type == device, what
            error = (got.float() - reference).abs().max() / reference.abs().max()
            assert error <= 2 ** -7, (what, error.item())
