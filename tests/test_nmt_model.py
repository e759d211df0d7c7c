"""The encoder-decoder NMT model under tensor and pipeline parallelism equals the single-process model;
incremental decoding equals the full forward; greedy and beam search find what they should, under any
pipeline layout.

Tolerance: fp32, rtol=1e-5 / atol=1e-6 on losses and gradients (different reduction orders only), as in
the GPT tests. Micro-batches have different sentence lengths (padding inside each, shapes changing between
micro-batches), so the pipeline messages (encoder and decoder states) go through the header protocol.
"""

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_distributed
from test_gpt_parallel import full_grads
from test_pipeline_parallel import check_against_reference, global_grads

from megatron_po import parallel_state as ps
from megatron_po.config import Config, ModelConfig, normalize_nmt
from megatron_po.distributed.ddp import DistributedDataParallel, allreduce_embedding_grads
from megatron_po.models.gpt import masked_mean_loss
from megatron_po.models.nmt import NMTModel
from megatron_po.pipeline.decode import Stepper, generate
from megatron_po.pipeline.executor import P2PTransport, synchronous_forward_backward
from megatron_po.pipeline.partition import build_nmt_chunks_for_rank
from megatron_po.tensor_parallel import model_parallel_seed

SEED = 11
PAD, BOS, EOS = 0, 2, 3
M = 4  # micro-batches

VARIANTS = {
    # learned positions, LayerNorm, GELU; one vocabulary: shared source/target embeddings tied to the output
    "shared": dict(model=dict(), nmt=dict(), vocab=(128, 128)),
    # RoPE, RMSNorm, SwiGLU, no biases; separate vocabularies and embeddings, untied output layer
    "separate": dict(model=dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                                add_bias_linear=False, untie_embeddings_and_output_weights=True),
                     nmt=dict(untie_encoder_decoder_embeddings=True), vocab=(128, 256)),
}


def make_cfg(variant="shared", encoder_layers=2, decoder_layers=2, **model):
    v = VARIANTS[variant]
    cfg = Config()
    cfg.model = ModelConfig(hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
                            attention_dropout=0.0, make_vocab_size_divisible_by=8, **{**v["model"], **model})
    cfg.nmt = dataclasses.replace(cfg.nmt, encoder_num_layers=encoder_layers, decoder_num_layers=decoder_layers,
                                  decoder_seq_length=18, label_smoothing=0.1, **v["nmt"])
    cfg.training.seed = SEED
    return normalize_nmt(cfg)


def make_batch(vocab, rows=2, seed=0):
    """Rows of different lengths, right-padded: a few padded source and target positions."""
    g = torch.Generator().manual_seed(seed)
    s, t = 7 + seed % 5, 5 + seed % 4
    src_len = torch.randint(2, s + 1, (rows,), generator=g)
    src_len[0] = s
    tgt_len = torch.randint(2, t + 1, (rows,), generator=g)
    tgt_len[-1] = t
    src = torch.randint(4, vocab[0], (rows, s), generator=g)
    y = torch.randint(4, vocab[1], (rows, t), generator=g)
    src_mask = torch.arange(s)[None] < src_len[:, None]
    loss_mask = (torch.arange(t)[None] < tgt_len[:, None]).float()
    tgt = torch.cat([torch.full((rows, 1), BOS), y[:, :-1]], 1)
    return {"src_tokens": src.masked_fill(~src_mask, PAD), "src_mask": src_mask,
            "tgt_tokens": tgt.masked_fill(loss_mask == 0, PAD), "labels": y.masked_fill(loss_mask == 0, PAD),
            "loss_mask": loss_mask}


def batches(vocab, n=M, dp=1):
    return [make_batch(vocab, seed=i) for i in range(n * dp)]


def reference(variant, layers=(2, 2), dp=1):
    torch.set_num_threads(1)
    cfg = make_cfg(variant, *layers)
    model = NMTModel(cfg.model, cfg.nmt, *VARIANTS[variant]["vocab"], SEED)
    bs = batches(VARIANTS[variant]["vocab"], dp=dp)
    losses = []
    for b in bs:
        loss = masked_mean_loss(model(b), b["loss_mask"])
        (loss / len(bs)).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean().item(), {f"model.{k}": p.grad for k, p in model.named_parameters()}


# ---- tensor parallel ------------------------------------------------------------------------------

def tp_run(variant):
    model_parallel_seed(SEED)
    cfg = make_cfg(variant)
    model = NMTModel(cfg.model, cfg.nmt, *VARIANTS[variant]["vocab"], SEED)
    losses = []
    for b in batches(VARIANTS[variant]["vocab"]):
        loss = masked_mean_loss(model(b), b["loss_mask"])
        (loss / M).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean().item(), {f"model.{k}": g for k, g in full_grads(model).items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_nmt_matches_single_process(variant):
    ref_loss, ref_grads = reference(variant)
    check_against_reference(run_distributed(tp_run, 2, tp=2, args=(variant,)), ref_loss, ref_grads)


# ---- pipeline parallel (+ TP, DP) -------------------------------------------------------------------

def pipeline_run(variant, layers, method, num_chunks):
    model_parallel_seed(SEED)
    cfg = make_cfg(variant, *layers)
    D = ps.get_pipeline_model_parallel_world_size()
    chunks = build_nmt_chunks_for_rank(cfg, VARIANTS[variant]["vocab"], ps.get_pipeline_model_parallel_rank(), D,
                                       num_chunks)
    ddp = DistributedDataParallel(chunks, ps.get_data_parallel_group(), bucket_size=20000)
    ddp.zero_grad()
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = batches(VARIANTS[variant]["vocab"], dp=dp)[d * M:(d + 1) * M]
    loss = synchronous_forward_backward(method, chunks, ddp, mine, message_specs=None)
    ddp.finish_grad_sync()
    allreduce_embedding_grads(ddp.params)
    if loss is not None and dp > 1:
        torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
        loss = loss / dp
    return (loss.item() if loss is not None else None), global_grads(chunks)


@pytest.mark.parametrize("variant,layers,method,v", [
    ("shared", (2, 2), "gpipe", 1),
    ("shared", (1, 3), "1f1b", 1),  # stage 0 holds the encoder and the first decoder layer
    ("separate", (2, 2), "1f1b", 1),
    ("shared", (2, 2), "1f1b", 2),  # interleaved: one layer per virtual stage
    ("separate", (3, 1), "1f1b", 2),
])
def test_pipeline_nmt_matches_unpipelined(variant, layers, method, v):
    ref_loss, ref_grads = reference(variant, layers)
    results = run_distributed(pipeline_run, 2, pp=2, args=(variant, layers, method, v))
    check_against_reference(results, ref_loss, ref_grads)


def test_tp2_pp2_dp2_nmt_matches_single_process():
    ref_loss, ref_grads = reference("shared", dp=2)
    results = run_distributed(pipeline_run, 8, tp=2, pp=2, args=("shared", (2, 2), "1f1b", 1))
    check_against_reference(results, ref_loss, ref_grads)


# ---- asynchronous methods ---------------------------------------------------------------------------

def async_run(distributed, method):
    from megatron_po.pipeline.async_pipeline import AsyncEmulator, AsyncPipelineRank
    model_parallel_seed(SEED)
    cfg = make_cfg("separate")
    vocab = VARIANTS["separate"]["vocab"]
    kwargs = dict(optimizer_name="adam", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.0}, clip_grad=0.0,
                  build_chunks=build_nmt_chunks_for_rank)
    get_batch = lambda mb: make_batch(vocab, seed=mb % 2)  # noqa: E731  (two batches, repeated)
    if distributed:
        engine = AsyncPipelineRank(cfg, vocab, method, 1, 1, **kwargs)
    else:
        engine = AsyncEmulator(cfg, vocab, method, 2, 1, 1, **kwargs)
    losses = engine.train_segment(get_batch, 8)
    return losses, engine.evaluate([make_batch(vocab, seed=0)]), engine.full_state_dict()


@pytest.mark.parametrize("method", ["pipeoptim", "pipedream"])
def test_async_nmt_pipeline_equals_emulator_and_learns(method):
    """Bitwise: same ops per rank in the same order, one thread (header messages change nothing)."""
    emu_losses, emu_eval, emu_weights = run_distributed(async_run, 1, args=(False, method))[0]
    results = run_distributed(async_run, 2, pp=2, args=(True, method))
    assert results[1][0] == emu_losses and results[1][1] == emu_eval
    weights = {**results[0][2], **results[1][2]}
    assert weights.keys() == emu_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], emu_weights[name]), name
    assert emu_eval < emu_losses[0] - 0.5  # it learns (the two repeated micro-batches, lr 1e-2)


# ---- decoding ---------------------------------------------------------------------------------------

def test_incremental_decoding_equals_full_forward():
    for variant in VARIANTS:
        cfg = make_cfg(variant, 1, 3)
        model = NMTModel(cfg.model, cfg.nmt, *VARIANTS[variant]["vocab"], SEED).eval()
        b = make_batch(VARIANTS[variant]["vocab"], rows=3, seed=2)
        full = model({k: b[k] for k in ("src_tokens", "src_mask", "tgt_tokens")})  # [t, rows, V]
        state = {}
        steps = [model.decode_step({**b, "tgt_tokens": b["tgt_tokens"][:, t:t + 1]}, None, state)
                 for t in range(b["tgt_tokens"].shape[1])]
        torch.testing.assert_close(torch.stack(steps), full, rtol=1e-5, atol=1e-5)  # fp32, other op order


def peaky_model(vocab=(128, 128), layers=(1, 3), init_std=0.5):
    """A random model with confident, varied predictions (a trained model is not needed to test search)."""
    cfg = make_cfg("shared", *layers, init_method_std=init_std)
    return cfg, NMTModel(cfg.model, cfg.nmt, *vocab, SEED).eval()


def test_greedy_decoding_equals_argmax_loop():
    cfg, model = peaky_model()
    b = make_batch((128, 128), rows=3, seed=4)
    max_len = 12
    out = generate(Stepper([model]), b["src_tokens"], b["src_mask"], bos=BOS, eos=EOS, pad=PAD, vocab_size=128,
                   max_length=max_len)
    for i in range(3):  # no cache: the whole prefix through the full forward at every step
        prefix = [BOS]
        for step in range(max_len):
            logits = model({"src_tokens": b["src_tokens"][i:i + 1], "src_mask": b["src_mask"][i:i + 1],
                            "tgt_tokens": torch.tensor([prefix])})[-1, 0]
            logits[[PAD, BOS]] = float("-inf")
            word = EOS if step == max_len - 1 else int(logits.argmax())
            if word == EOS:
                break
            prefix.append(word)
        assert out[i] == prefix[1:]
    assert len({tuple(o) for o in out}) == 3 and all(out)  # distinct, non-empty: the check has teeth


def test_beam_search_finds_the_best_hypothesis_exhaustively():
    """Tiny vocabulary (4 words + 4 specials), 3 steps: a beam as wide as the number of live prefixes
    is exact search, so it must return the argmax of log p / length**alpha over every output."""
    vocab, max_len, alpha = 8, 3, 0.7
    cfg, model = peaky_model(vocab=(vocab, vocab), init_std=0.3)
    b = make_batch((vocab, vocab), rows=2, seed=1)
    beam = generate(Stepper([model]), b["src_tokens"], b["src_mask"], bos=BOS, eos=EOS, pad=PAD, vocab_size=vocab,
                    max_length=max_len, beam_size=16, length_penalty=alpha)
    words = [w for w in range(vocab) if w not in (PAD, BOS, EOS)]
    for i in range(2):
        def score(seq):
            tgt = torch.tensor([[BOS] + seq])
            logits = model({"src_tokens": b["src_tokens"][i:i + 1], "src_mask": b["src_mask"][i:i + 1],
                            "tgt_tokens": tgt})[:, 0, :vocab]
            logits[:, [PAD, BOS]] = float("-inf")
            lp = F.log_softmax(logits.float(), -1)
            total = sum(lp[t, w].item() for t, w in enumerate(seq + [EOS]))
            return total / (len(seq) + 1) ** alpha
        candidates = [list(c) for n in range(max_len) for c in itertools.product(words, repeat=n)]
        best = max(candidates, key=score)
        assert beam[i] == best, (beam[i], best)
        assert math.isclose(score(beam[i]), max(score(c) for c in candidates), rel_tol=1e-6)
    greedy = generate(Stepper([model]), b["src_tokens"], b["src_mask"], bos=BOS, eos=EOS, pad=PAD, vocab_size=vocab,
                      max_length=max_len)
    assert greedy != beam  # this model's greedy path is not the best one: the search mattered


def decode_run(beam_size, num_chunks):
    """Beam search through this rank's chunks of a (TP x) PP layout; the output on the last stage."""
    cfg, _ = peaky_model(layers=(2, 2))
    D = ps.get_pipeline_model_parallel_world_size()
    chunks = [c.eval() for c in build_nmt_chunks_for_rank(cfg, (128, 128), ps.get_pipeline_model_parallel_rank(),
                                                           D, num_chunks)]
    b = make_batch((128, 128), rows=3, seed=4)
    stepper = Stepper(chunks, ps.get_pipeline_model_parallel_rank(), D, P2PTransport(D, num_chunks) if D > 1 else None)
    return generate(stepper, b["src_tokens"], b["src_mask"], bos=BOS, eos=EOS, pad=PAD, vocab_size=128,
                    max_length=10, beam_size=beam_size)


@pytest.mark.parametrize("tp,pp,v", [(1, 2, 1), (1, 2, 2), (2, 2, 1)])
def test_pipelined_decoding_equals_single_process(tp, pp, v):
    for beam_size in (1, 3):
        ref = run_distributed(decode_run, 1, args=(beam_size, 1))[0]
        results = run_distributed(decode_run, tp * pp, tp=tp, pp=pp, args=(beam_size, v))
        last_stage = [r for r in results if r is not None]
        assert len(last_stage) == tp and all(r == ref for r in last_stage), (results, ref)
