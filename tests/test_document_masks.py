"""--reset-position-ids / --reset-attention-mask (Megatron's get_ltor_masks_and_position_ids) and --eod-mask-loss.

- The document ids and positions of a packed sample, by hand.
- Closed form of the mask: with both flags, the logits of a document packed after another equal the logits of
  that document run alone (learned positions and RoPE), and the first document's are unchanged.
- TP=2 x PP=2 equals one process with both flags and --eod-mask-loss (every stage reads the batch), and the
  flags change the loss (the documents of the mock data really are split).
"""

import pytest
import torch
from dist_harness import run_distributed

from megatron_po.data.document_masks import document_causal_mask, document_ids, document_position_ids

EOD = 9


def test_document_ids_and_positions_by_hand():
    tokens = torch.tensor([[1, 2, EOD, 3, 4, 5, EOD, EOD, 6], [EOD, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert document_ids(tokens, EOD).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1]]
    assert document_position_ids(tokens, EOD).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 0, 1, 2, 3, 4, 5, 6, 7]]
    mask = document_causal_mask(document_ids(tokens, EOD))
    assert mask.shape == (2, 1, 9, 9)
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False, False]


def _packed_equals_alone(position_embedding_type):
    from megatron_po.config import ModelConfig
    from megatron_po.data.document_masks import add_document_inputs
    from megatron_po.models.gpt import GPTModel
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=12, hidden_dropout=0.0,
                      attention_dropout=0.0, position_embedding_type=position_embedding_type)
    model = GPTModel(cfg, 16, seed=5).eval()
    a, b = [1, 2, 3, EOD], [4, 5, 6, 7, 8, 1, 2, 3]
    packed = {"tokens": torch.tensor([a + b])}
    add_document_inputs(packed, EOD, True, True)
    with torch.no_grad():
        both = model(packed)  # [s, b, V]
        alone_b = model(torch.tensor([b]))
        alone_a = model(torch.tensor([a]))
        plain = model(torch.tensor([a + b]))
    torch.testing.assert_close(both[len(a):], alone_b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[:len(a)], alone_a, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain[len(a):], alone_b, atol=1e-3)  # without the flags b sees a
    return True


@pytest.mark.parametrize("pos", ["learned_absolute", "rope"])
def test_packed_document_equals_document_alone(pos):
    assert run_distributed(_packed_equals_alone, 1, args=(pos,), timeout=120) == [True]


def _run(tmp_path, name, world, extra):
    from test_pretrain_gpt import read_metrics, run_pretrain
    out = tmp_path / name
    argv = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "12", "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1",
            "--position-embedding-type", "rope", "--make-vocab-size-divisible-by", "4",
            "--metrics-file", str(out / "m.jsonl")] + extra
    assert run_distributed(run_pretrain, world, args=(argv,), timeout=300) == [0] * world
    return [r["lm_loss"] for r in read_metrics(out / "m.jsonl") if "lm_loss" in r]


def test_reset_flags_tp2_pp2_equal_one_process(tmp_path):
    flags = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
    one = _run(tmp_path, "one", 1, flags)
    four = _run(tmp_path, "four", 4, flags + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                             "2"])
    assert four == pytest.approx(one, rel=1e-5)
    plain = _run(tmp_path, "plain", 1, ["--eod-mask-loss"])
    assert plain[0] != pytest.approx(one[0], rel=1e-4)
