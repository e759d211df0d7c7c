"""Config tree -> Megatron flags, validation rules, launch environment (torchrun / Slurm / single)."""

import pytest

from megatron_po.config import Config, build_parser, num_microbatches, parse_args
from megatron_po.config_rules import validate
from megatron_po.errors import ConfigError
from megatron_po.parallel_state import coords_of, first_slurm_host, rank_of, read_launch_env


def test_megatron_flag_names_are_generated():
    flags = {a for action in build_parser()._actions for a in action.option_strings}
    for name in ["--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--max-position-embeddings", "--micro-batch-size", "--global-batch-size", "--train-iters",
                 "--lr", "--min-lr", "--lr-decay-style", "--lr-warmup-iters", "--weight-decay", "--adam-beta1",
                 "--adam-beta2", "--clip-grad", "--seed", "--eval-interval", "--eval-iters", "--log-interval",
                 "--save", "--load", "--save-interval", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage", "--sequence-parallel",
                 "--data-path", "--split", "--tokenizer-type", "--tokenizer-model", "--mock-data", "--vocab-size",
                 "--untie-embeddings-and-output-weights", "--init-method-std", "--hidden-dropout",
                 "--attention-dropout", "--make-vocab-size-divisible-by", "--wandb-project", "--wandb-exp-name",
                 "--wandb-entity", "--wandb-save-dir", "--metrics-file", "--pipeline-method", "--swiglu",
                 "--normalization", "--position-embedding-type", "--no-add-bias-linear"]:
        assert name in flags, name


def test_parse_args_fills_the_tree():
    cfg = parse_args(["--hidden-size", "256", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                      "--data-path", "0.3", "A", "0.7", "B", "--no-add-bias-linear", "--lr", "1e-3"])
    assert isinstance(cfg, Config)
    assert cfg.model.hidden_size == 256 and cfg.model.add_bias_linear is False
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.sequence_parallel
    assert cfg.data.data_path == ["0.3", "A", "0.7", "B"] and cfg.training.lr == 1e-3


def test_bad_flag_value_is_a_config_error():
    with pytest.raises(ConfigError, match="--lr-decay-style"):
        parse_args(["--lr-decay-style", "sideways"])


def cfg_with(**kw):
    cfg = parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"])
    for section in ("model", "parallel", "training", "data"):
        for k, v in list(kw.items()):
            if hasattr(getattr(cfg, section), k):
                setattr(getattr(cfg, section), k, v)
                kw.pop(k)
    assert not kw, kw
    return cfg


@pytest.mark.parametrize("world,kw,message", [
    (3, dict(tensor_model_parallel_size=2), "world size 3 is not divisible"),
    (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4), "world size 4"),
    (2, dict(tensor_model_parallel_size=2, hidden_size=33, num_attention_heads=11), "--hidden-size (33) is not divisible by --tensor"),
    (1, dict(hidden_size=100, num_attention_heads=3), "--hidden-size (100) is not divisible by --num-attention-heads"),
    (2, dict(tensor_model_parallel_size=2, hidden_size=96, num_attention_heads=3), "--num-attention-heads (3)"),
    (2, dict(pipeline_model_parallel_size=2, num_layers=3), "--num-layers (3)"),
    (2, dict(micro_batch_size=3, global_batch_size=8), "--global-batch-size (8)"),
    (2, dict(tensor_model_parallel_size=2, sequence_parallel=True, seq_length=63), "--sequence-parallel"),
    (1, dict(seq_length=512, max_position_embeddings=256), "--seq-length (512) exceeds"),
    (1, dict(min_lr=1.0, lr=0.1), "--min-lr"),
])
def test_validation_rules(world, kw, message):
    with pytest.raises(ConfigError) as e:
        validate(cfg_with(**kw), world)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_microbatches_from_batch_sizes():
    cfg = cfg_with(micro_batch_size=2, global_batch_size=16, tensor_model_parallel_size=2)
    validate(cfg, 8)  # TP 2 x DP 4
    assert num_microbatches(cfg, 8) == 2


def test_rank_layout_is_tp_fastest_then_dp_then_pp():
    tp, dp, pp = 2, 3, 2
    seen = set()
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                r = rank_of(t, d, p, tp, dp)
                assert coords_of(r, tp, dp) == (t, d, p)
                seen.add(r)
    assert seen == set(range(tp * dp * pp))
    assert rank_of(1, 0, 0, tp, dp) == 1 and rank_of(0, 1, 0, tp, dp) == 2 and rank_of(0, 0, 1, tp, dp) == 6


def test_launch_env_from_torchrun_slurm_or_nothing():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1",
                           "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.launcher) == \
        (3, 8, 1, "n1", 1234, "torchrun")
    env = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                           "SLURM_STEP_NODELIST": "gpu[07-08,11]", "SLURM_JOB_ID": "4242"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher) == (5, 8, 1, "gpu07", "slurm")
    assert env.master_port == 20000 + 4242
    assert read_launch_env({}).launcher == "single"


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("node[03-05,9]", "node03"),
                                            ("a[1,2],b[3-4]", "a1"), ("host-x,host-y", "host-x")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first
