"""The launcher, logging and checkpoint-loading flags of public Megatron recipes (megatron_po/config_recipe.py),
each doing what Megatron's does:

- --lr-warmup-init: the warm-up climbs from it, init + (lr - init) x (i + 1) / W at iteration i (this code's
  warm-up clock), the decoupled lr's warm-up too; 0 is the former rule to the bit.
- --logging-level (and Megatron's MEGATRON_LOGGING_LEVEL) set Python's root logger.
- TensorBoard gets the timers and throughput, the memory, the validation perplexity only with
  --log-timers-to-tensorboard, --log-memory-to-tensorboard, --log-validation-ppl-to-tensorboard;
  --tensorboard-queue-size is the writer's queue.
- --padded-vocab-size is the model's vocabulary (the embedding's rows).
- --trust-remote-code lets a local tokenizer directory's own code run; without it the tokenizer is refused.
- --dist-ckpt-strictness on one launch of five runs: a checkpoint with a tensor the model lacks (learned positions
  loaded into a RoPE model) stops the default load, loads under log_all with a line naming it; a checkpoint that
  lacks a parameter (RoPE into learned positions) stops raise_unexpected, loads under log_unexpected (the
  iteration resumed, the parameter kept as initialized).
- --use-rotary-position-embeddings is --position-embedding-type rope; --moe-enable-deepep's flex dispatcher is
  the alltoall one; --cuda-graph-impl / --cuda-graph-scope / --te-rng-tracker / the CPU offload flags are accepted
  with one start-up line (--use-precision-aware-optimizer: tests/test_precision_aware_optimizer.py;
  --recompute-modules: tests/test_recompute.py, tests/test_moe_layer.py; --moe-router-force-load-balancing:
  tests/test_moe_layer.py).
The recipe-style command line with all of them trains in tests/test_moe_recipes.py (DeepSeek-V3 with ModelZoo's
launcher flags); the one-line start-up errors are rows of tests/test_config_rules.py.
"""

import json
import logging

import pytest
from dist_harness import run_distributed, run_mains

from megatron_po.config import parse_args
from megatron_po.config_rules import validate
from megatron_po.errors import ConfigError, DataError
from megatron_po.optim.sample_schedule import SampleSchedule, microbatch_lr

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def test_lr_warmup_init_starts_the_warm_up_there():
    lr, init, low, W = 1e-3, 1e-4, 1e-5, 5
    cfg = parse_args(MOCK + ["--global-batch-size", "8", "--micro-batch-size", "4", "--train-iters", "20",
                             "--lr", str(lr), "--min-lr", str(low), "--lr-warmup-iters", str(W),
                             "--lr-warmup-init", str(init), "--lr-decay-style", "linear", "--decoupled-lr", "2e-3"])
    validate(cfg, 1)
    s = SampleSchedule(cfg, 1)
    for i in range(20):
        if i < W:  # Megatron's init + (max - init) x steps / W, on this code's clock (a step completes i + 1)
            want, decoupled = init + (lr - init) * (i + 1) / W, init + (2e-3 - init) * (i + 1) / W
        else:
            want = lr - (lr - low) * (i - W) / (20 - W)
            decoupled = 2e-3 - 2e-3 * (i - W) / (20 - W)
        assert s.lr_at(i) == pytest.approx(want, rel=1e-12), i
        assert s.decoupled_lr_at(i) == pytest.approx(decoupled, rel=1e-12), i
    assert s.lr_at(0) > init and s.lr_at(W - 1) == lr
    t = cfg.training  # the studies' micro-batch clock (bench/) reads it too
    assert microbatch_lr(0, 1, t) == pytest.approx(init + (lr - init) / W, rel=1e-12)
    t.lr_warmup_init = 0.0  # the former rule, to the bit
    assert [microbatch_lr(i, 1, t) for i in range(W)] == [lr * (i + 1) / W for i in range(W)]


def test_logging_level_sets_the_root_logger(monkeypatch):
    from megatron_po.training_setup import set_logging_level
    root = logging.getLogger()
    before = root.level
    monkeypatch.setattr(root, "level", before)  # restored after the test
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
    assert set_logging_level(parse_args(MOCK)) is None and root.level == before
    assert set_logging_level(parse_args(MOCK + ["--logging-level", "40"])) == 40 and root.level == logging.ERROR
    assert not logging.getLogger("a_library.module").isEnabledFor(logging.WARNING)
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "20")  # Megatron's environment variable, below the flag
    assert set_logging_level(parse_args(MOCK)) == 20 and root.level == logging.INFO
    assert set_logging_level(parse_args(MOCK + ["--logging-level", "30"])) == 30
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "loud")
    with pytest.raises(ConfigError, match="MEGATRON_LOGGING_LEVEL='loud' is not an integer"):
        set_logging_level(parse_args(MOCK))


def test_tensorboard_gets_timers_memory_and_perplexity_only_when_asked():
    from megatron_po.training_log import tensorboard_keeps
    asked = ["time/optimizer", "tokens_per_sec", "tflops_per_gpu", "mfu", "memory_gb", "max_memory_gb", "val_ppl"]
    always = ["lm_loss", "lr", "grad_norm", "val_loss", "staleness/stage0", "moe/aux_loss/layer1", "mtp_loss"]
    keeps = tensorboard_keeps(parse_args(MOCK).logging)
    assert [k for k in asked + always if keeps(k)] == always  # Megatron's defaults
    flags = ["--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard"]
    keeps = tensorboard_keeps(parse_args(MOCK + flags).logging)
    assert all(keeps(k) for k in asked + always)
    for flag, keys in zip(flags, [asked[:4], asked[4:6], asked[6:]]):
        keeps = tensorboard_keeps(parse_args(MOCK + [flag]).logging)
        assert [k for k in asked if keeps(k)] == keys, flag


def test_tensorboard_queue_size_is_the_writers_queue(tmp_path, monkeypatch):
    from megatron_po import training_log
    monkeypatch.setattr(training_log.dist, "get_rank", lambda: 0)
    cfg = parse_args(MOCK + ["--tensorboard-dir", str(tmp_path), "--tensorboard-queue-size", "7"])
    logger = training_log.Logger(cfg, active=True)
    assert logger.tensorboard.file_writer.event_writer._async_writer._byte_queue.maxsize == 7  # tensorboard's writer
    logger.close()


def test_padded_vocab_size_is_the_models_vocabulary():
    from megatron_po.gpt_workload import GPTWorkload
    workload = GPTWorkload(parse_args(MOCK + ["--padded-vocab-size", "160"]))
    workload.setup()
    assert (workload.tokenizer.vocab_size, workload.padded_vocab) == (101, 160)
    workload = GPTWorkload(parse_args(MOCK + ["--tensor-model-parallel-size", "2"]))
    workload.setup()
    assert workload.padded_vocab == 256  # without it: 101 padded to a multiple of 128 x TP


@pytest.fixture
def shipped_tokenizer(tmp_path):
    """A local Hugging Face tokenizer directory whose tokenizer class is Python code it ships (auto_map)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + [f"w{i}" for i in range(10)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ShippedTokenizer", "eos_token": "<eos>", "unk_token": "<unk>",
        "auto_map": {"AutoTokenizer": [None, "shipped_tokenizer.ShippedTokenizer"]}}))
    (tmp_path / "shipped_tokenizer.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class ShippedTokenizer(PreTrainedTokenizerFast):\n    shipped = True\n")
    return str(tmp_path)


def test_trust_remote_code_runs_the_tokenizers_own_code(shipped_tokenizer, monkeypatch):
    from megatron_po.data.tokenizer import build_tokenizer_from
    monkeypatch.setattr("sys.stdin", open("/dev/null"))  # transformers would ask on a terminal
    flags = ["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", shipped_tokenizer]
    tok = build_tokenizer_from(parse_args(flags + ["--trust-remote-code"]).data)
    assert type(tok.tokenizer).__name__ == "ShippedTokenizer" and tok.tokenizer.shipped
    assert (tok.vocab_size, tok.tokenize("w1 w2"), tok.eod) == (12, [3, 4], 1)
    with pytest.raises(DataError, match="ships its own Python code .* add --trust-remote-code"):
        build_tokenizer_from(parse_args(flags).data)
    # --padded-vocab-size is checked against this tokenizer's 12 ids at start-up
    with pytest.raises(ConfigError, match=r"--padded-vocab-size \(8\) is smaller than the tokenizer's vocabulary "
                                          r"\(12\)"):
        validate(parse_args(flags + ["--trust-remote-code", "--padded-vocab-size", "8"]), 1)


def _tiny(out, iters, *extra):
    return MOCK + ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                   "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters), "--lr", "1e-3",
                   "--log-interval", "1", "--eval-iters", "0", "--make-vocab-size-divisible-by", "4",
                   "--metrics-file", str(out / "metrics.jsonl"), *extra]


def test_dist_ckpt_strictness_on_tensors_only_one_side_has(tmp_path, capfd):
    learned, rope = [], ["--position-embedding-type", "rope"]  # rope: no position table
    runs = {  # name: (argv, exit code)
        "save_learned": (_tiny(tmp_path / "a", 2, "--save", str(tmp_path / "ck_learned"), *learned), 0),
        "rope_default": (_tiny(tmp_path / "b", 3, "--load", str(tmp_path / "ck_learned"), *rope), 2),
        "rope_log_all": (_tiny(tmp_path / "c", 3, "--load", str(tmp_path / "ck_learned"), "--dist-ckpt-strictness",
                               "log_all", "--save", str(tmp_path / "ck_rope"), *rope), 0),
        "learned_raise": (_tiny(tmp_path / "d", 4, "--load", str(tmp_path / "ck_rope"), "--dist-ckpt-strictness",
                                "raise_unexpected"), 2),
        "learned_log": (_tiny(tmp_path / "e", 4, "--load", str(tmp_path / "ck_rope"), "--dist-ckpt-strictness",
                              "log_unexpected"), 0),
    }
    codes = run_distributed(run_mains, 1, args=([argv for argv, _ in runs.values()],), timeout=300)
    assert codes == [[code for _, code in runs.values()]]
    out, err = capfd.readouterr()
    table = "embedding.position_embeddings.weight"
    assert f"the checkpoint has parameter {table} that this model lacks" in err  # raise_all, the default here
    assert f"1 tensors of the checkpoint are not in this model, not loaded (--dist-ckpt-strictness log_all): " \
           f"{table}" in out
    assert f"parameter {table} is not in the checkpoint" in err  # raise_unexpected
    assert f"1 parameters of this model are not in the checkpoint and keep their initial values " \
           f"(--dist-ckpt-strictness log_unexpected): {table}" in out

    def iterations(name):
        with open(tmp_path / name / "metrics.jsonl") as f:
            return [r["iteration"] for r in map(json.loads, f) if "lm_loss" in r]
    assert iterations("c") == [3] and iterations("e") == [4]  # both resumed where their checkpoint left off


def test_model_recipe_flags_megatron_spellings_and_no_op_lines():
    """--use-rotary-position-embeddings sets --position-embedding-type rope (over that flag, as Megatron's);
    --moe-enable-deepep with the flex dispatcher runs the alltoall one; CUDA graphs, TE's RNG tracker and the CPU
    offload of a CPU run are accepted with one start-up line saying what runs instead."""
    from megatron_po.config_recipe_rules import recipe_notes
    from megatron_po.models.moe.dispatcher import DISPATCHERS, AllToAllDispatcher
    from megatron_po.models.moe.rules import no_op_switches_line
    cfg = parse_args(MOCK + ["--position-embedding-type", "learned_absolute", "--use-rotary-position-embeddings"])
    validate(cfg, 1)
    assert cfg.model.position_embedding_type == "rope"
    assert recipe_notes(cfg) == ["> --use-rotary-position-embeddings: Megatron's older spelling of "
                                 "--position-embedding-type rope (in effect)"]
    assert recipe_notes(parse_args(MOCK)) == []
    moe = parse_args(MOCK + ["--num-experts", "4", "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep"])
    validate(moe, 1)
    assert DISPATCHERS[moe.model.moe_token_dispatcher_type] is AllToAllDispatcher
    assert "--moe-token-dispatcher-type flex, --moe-enable-deepep: accepted, no effect here" in \
        no_op_switches_line(moe.model)
    flags = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "moe_router", "--te-rng-tracker",
             "--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
             "--optimizer-offload-fraction", "1.0", "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1", "--recompute-modules", "moe_act"]  # no effect: full
    cfg = parse_args(MOCK + flags)
    validate(cfg, 1)  # on the CPU; on a GPU --optimizer-cpu-offload is refused (tests/test_config_rules.py)
    notes = recipe_notes(cfg)
    assert len(notes) == 3 and all("\n" not in line for line in notes)
    assert notes[0] == ("> --recompute-modules moe_act: no effect without --recompute-granularity selective (as in "
                        "Megatron)")
    assert notes[1].startswith("> --cuda-graph-impl, --cuda-graph-scope, --te-rng-tracker, --optimizer-cpu-offload, "
                               "--overlap-cpu-optimizer-d2h-h2d: accepted, no effect here")
    assert "the optimizer state and step are on the CPU already" in notes[1]
    assert notes[2].startswith("> --use-precision-aware-optimizer: Adam's exp_avg stored in fp32")
