"""Megatron-LM's own example launch scripts run here with their flag lists unchanged but for sizes.

GPT3_175B copies NVIDIA/Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh (GPT_MODEL_ARGS, TRAINING_ARGS,
MODEL_PARALLEL_ARGS, DATA_ARGS, EVAL_AND_LOGGING_ARGS); LLAMA3_8B copies examples/llama/train_llama3_8b_h100_fp8.sh
(MODEL_ARGS, TRAINING_ARGS + DDP_ARGS, MODEL_PARALLEL_ARGS, the real-data DATA_ARGS_LIST, EVAL_AND_LOGGING_ARGS).
Changed: sizes (layers, hidden, heads, sequence, batches, iterations/samples, intervals, vocab), the parallel
layout (GPT-3: TP=2 x PP=2; Llama-3: TP=2 x DP=2 + sequence parallel + distributed optimizer) and paths;
dropped: the FP8 block (DTYPE_ARGS; no FP8 on CPU); Llama-3's `--attention-backend fused` (cuDNN, CUDA only) is
auto here. `--fp16` stays (fp16 runs on CPU here).

Each runs on 4 CPU processes on the bundled corpus preprocessed with the scripts' tokenizers (GPT-2 BPE with
--vocab-file/--merge-file; a Hugging Face tokenizer directory) and its loss falls.
"""

import json

import pytest
from dist_harness import run_distributed


def run_pretrain(argv):
    from megatron_po.training import run_main
    return run_main(argv)


def gpt3_175b(data, out):
    """examples/gpt3/train_gpt3_175b_distributed.sh, sizes reduced."""
    gpt_model_args = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "64", "--max-position-embeddings", "64",
                      "--attention-backend", "auto"]
    training_args = ["--micro-batch-size", "1", "--global-batch-size", "8",
                     "--rampup-batch-size", "4", "4", "32",
                     "--train-iters", "30", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                     "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16",
                     "--lr", "6.0e-3", "--lr-decay-style", "cosine", "--min-lr", "6.0e-4",
                     "--lr-warmup-fraction", ".1", "--lr-decay-iters", "28"]
    model_parallel_args = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    data_args = ["--data-path", data["prefix"], "--vocab-file", data["vocab_file"],
                 "--merge-file", data["merge_file"], "--split", "94,5,1"]  # script: 949,50,1 (a 0.1% test split is empty on a small corpus)
    eval_and_logging_args = ["--log-interval", "1", "--save-interval", "30", "--eval-interval", "15",
                             "--save", str(out / "ckpt"), "--load", str(out / "ckpt"), "--eval-iters", "2",
                             "--tensorboard-dir", str(out / "tb")]
    # ours: where the numbers go, and the padded vocabulary a small model needs
    return (gpt_model_args + training_args + model_parallel_args + data_args + eval_and_logging_args
            + ["--tokenizer-type", "GPT2BPETokenizer", "--metrics-file", str(out / "metrics.jsonl"),
               "--data-cache-path", str(out / "cache")])


def llama3_8b(data, out):
    """examples/llama/train_llama3_8b_h100_fp8.sh with real data (DATA_ARGS_LIST's else branch), sizes reduced,
    DTYPE_ARGS (FP8) dropped."""
    model_args = ["--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "192",
                  "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
                  "--kv-channels", "16", "--seq-length", "64", "--max-position-embeddings", "64",
                  "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
                  "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
                  "--attention-backend", "auto",  # script: fused (cuDNN kernels, CUDA only; a clear error on CPU)
                  "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
                  "--disable-bias-linear"]
    training_args = ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "240",
                     "--lr-decay-samples", "232", "--lr-warmup-samples", "24", "--lr", "0.003", "--min-lr", "0.0002",
                     "--decoupled-lr", "5.0e-3", "--decoupled-min-lr", "4.5e-4", "--lr-decay-style", "cosine",
                     "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                     "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--calculate-per-token-loss",
                     "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235"]
    ddp_args = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    model_parallel_args = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "1", "--sequence-parallel"]
    data_args = ["--data-path", data["prefix"], "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", data["model"], "--data-cache-path", str(out / "cache"),
                 "--split", "99,1,0", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
                 "--num-workers", "1", "--vocab-size", str(hf_vocab_size(data["model"]))]
    eval_and_logging_args = ["--log-interval", "1", "--eval-iters", "2", "--eval-interval", "15",
                             "--save-interval", "1000", "--log-throughput", "--profile", "--profile-step-start", "4",
                             "--profile-step-end", "6", "--ckpt-format", "torch_dist",
                             "--distributed-timeout-minutes", "60", "--save", str(out / "ckpt"),
                             "--load", str(out / "ckpt"), "--tensorboard-dir", str(out / "tb")]
    return (model_args + training_args + ddp_args + model_parallel_args + data_args + eval_and_logging_args
            + ["--metrics-file", str(out / "metrics.jsonl")])


def hf_vocab_size(tokenizer_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json").get_vocab_size()


def losses(path):
    with open(path) as f:
        return [r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r]


def assert_loss_falls(path, iters):
    loss = losses(path)
    assert len(loss) == iters, loss
    first, last = sum(loss[:3]) / 3, sum(loss[-3:]) / 3
    assert last < first - 0.3, (first, last)


def test_gpt3_175b_script_flags_tp2_pp2(bpe_corpus, tmp_path):
    argv = gpt3_175b(bpe_corpus, tmp_path)
    assert run_distributed(run_pretrain, 4, args=(argv,), timeout=600) == [0] * 4
    assert_loss_falls(tmp_path / "metrics.jsonl", 30)
    assert (tmp_path / "ckpt").is_dir()


def test_llama3_8b_script_flags_tp2_dp2_sp_distopt(hf_corpus, tmp_path):
    argv = llama3_8b(hf_corpus, tmp_path)
    assert run_distributed(run_pretrain, 4, args=(argv,), timeout=600) == [0] * 4
    assert_loss_falls(tmp_path / "metrics.jsonl", 240 // 8)
    traces = list((tmp_path / "tb").glob("trace_rank0_iter4-6.pt.trace.json"))
    assert traces and "traceEvents" in json.loads(traces[0].read_text())
