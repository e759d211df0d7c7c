"""Every rule of `config_rules.RULES`, one table row each.

Each row names a rule (its id; "rule/case" is another case of the same rule) and gives a command line and
a world size that break that rule and no rule checked before it, and words the one-line ConfigError must
contain (the flags and the rule). RULES are pretrain_gpt.py command lines; NMT_RULES are pretrain_nmt.py's,
read as its workload reads them (`normalize_nmt`, then `validate(..., "nmt")`). The error names the rule
that fired (`error.rule`), which must be the row's; `test_every_rule_has_a_row` reads the table and fails
when a rule has no row, so a new rule comes with its case.
"""

import fake_transformer_engine
import pytest

from megatron_po import config_check, config_rules
from megatron_po.config import normalize_nmt, parse_args
from megatron_po.config_rules import validate
from megatron_po.errors import ConfigError
from megatron_po.models import fp8, te_transformer

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
PP2_ASYNC = MOCK + ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]
PP2 = MOCK + ["--pipeline-model-parallel-size", "2"]
TE = ["--transformer-impl", "transformer_engine"]
TE_FP8 = MOCK + TE + ["--fp8-format", "hybrid"]  # default sizes: hidden 128, MLP 512, 128 x 4 tokens
NMT = ["--data-path", "corpus", "--tokenizer-model", "t.model"]  # pretrain_nmt.py: one corpus prefix, en -> fr
CP2 = MOCK + ["--context-parallel-size", "2", "--attention-dropout", "0"]  # valid on 2 ranks
MLA = MOCK + ["--multi-latent-attention"]  # Megatron's default sizes
MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]

# (id, world size, argv, words the error line must contain)
RULES = [
    # sizes and counts
    ("tensor-model-parallel-size>=1", 1, MOCK + ["--tensor-model-parallel-size", "0"],
     ["--tensor-model-parallel-size must be >= 1 (got 0)"]),
    ("micro-batch-size>=1", 1, MOCK + ["--micro-batch-size", "0"], ["--micro-batch-size must be >= 1"]),
    ("global-batch-size>=1", 1, MOCK + ["--global-batch-size", "0"], ["--global-batch-size must be >= 1 (got 0)"]),
    ("exit-interval>=1", 1, MOCK + ["--exit-interval", "0"], ["--exit-interval must be >= 1"]),
    ("lr-decay-iters>=1", 1, MOCK + ["--lr-decay-iters", "0"], ["--lr-decay-iters must be >= 1"]),
    ("ffn-hidden-size>=1", 1, MOCK + ["--ffn-hidden-size", "0"], ["--ffn-hidden-size must be >= 1"]),
    ("ddp-bucket-size>=1", 1, MOCK + ["--ddp-bucket-size", "0"], ["--ddp-bucket-size must be >= 1"]),
    ("eval-iters>=0", 1, MOCK + ["--eval-iters", "-1"], ["--eval-iters must be >= 0"]),
    ("num-workers>=0", 1, MOCK + ["--num-workers", "-2"], ["--num-workers must be >= 0"]),
    ("clip-grad>=0", 1, MOCK + ["--clip-grad", "-1"], ["--clip-grad must be >= 0"]),
    ("pipeoptim-s-offset>=0", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--pipeoptim-s-offset", "-1"],
     ["--pipeoptim-s-offset must be >= 0"]),
    ("timeout>0", 1, MOCK + ["--distributed-timeout-minutes", "0"], ["--distributed-timeout-minutes must be > 0"]),
    ("timeout-finite", 1, MOCK + ["--distributed-timeout-minutes", "inf"],
     ["--distributed-timeout-minutes must be finite (got inf)"]),
    ("seed-range", 1, MOCK + ["--seed", "-1"], ["--seed must be in [0, 4294967296) (got -1)"]),
    ("seed-range/per-stage", 2, PP2_ASYNC + ["--seed", str(2**32 - 100)],
     ["--seed must be in [0, 4294967196) (got 4294967196)", "seed + 100 x s", "--pipeline-model-parallel-size 2"]),
    ("max-skipped-steps>=0", 1, MOCK + ["--max-skipped-steps", "-1"], ["--max-skipped-steps must be >= 0 (got -1"]),
    ("finetune-save-is-load", 1, MOCK + ["--finetune", "--load", "ck", "--save", "ck"],
     ["--finetune with --save equal to --load (ck)"]),
    ("adam-betas", 1, MOCK + ["--adam-beta2", "1.0"], ["--adam-beta2 (1.0)", "[0, 1)"]),
    ("epsilons>0", 1, MOCK + ["--norm-epsilon", "0"], ["--norm-epsilon (0.0) must be > 0"]),
    ("sgd-momentum", 1, MOCK + ["--sgd-momentum", "1.5"], ["--sgd-momentum must be in [0, 1)"]),
    ("muon-settings", 1, MOCK + ["--optimizer", "muon", "--muon-num-ns-steps", "0"],
     ["--muon-num-ns-steps (0)", ">= 1", "--muon-momentum", "--muon-extra-scale-factor"]),
    ("muon-ns-coefficients", 1, MOCK + ["--optimizer", "muon", "--muon-coefficient-type", "polar_express"],
     ["--muon-coefficient-type polar_express with --muon-num-ns-steps 5", "at least 8 steps"]),
    ("init-std>0", 1, MOCK + ["--init-method-std", "0"], ["--init-method-std must be > 0"]),
    ("peak-tflops>0", 1, MOCK + ["--peak-tflops", "0"], ["--peak-tflops must be > 0"]),
    ("wsd-iters-need-wsd", 1, MOCK + ["--lr-wsd-decay-iters", "5"],
     ["--lr-wsd-decay-iters applies to --lr-decay-style wsd, not cosine"]),
    ("pipeoptim-flags-need-pipeoptim", 1, MOCK + ["--pipeoptim-extrapolate-weight-decay"],
     ["--pipeoptim-extrapolate-weight-decay apply to --pipeline-method pipeoptim, not 1f1b"]),
    ("lookahead-needs-sgd", 1, MOCK + ["--pipeoptim-sgd-direction", "lookahead"],
     ["--pipeoptim-sgd-direction lookahead applies to --optimizer sgd, not adamw"]),
    # layout
    ("world-vs-tpxpp/tp", 3, MOCK + ["--tensor-model-parallel-size", "2"],
     ["world size 3 is not divisible by --tensor-model-parallel-size (2) x --pipeline-model-parallel-size (1)"]),
    ("world-vs-tpxpp", 4, MOCK + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"],
     ["world size 4", "= 8"]),
    ("context-parallel-size>=1", 1, MOCK + ["--context-parallel-size", "0"],
     ["--context-parallel-size must be >= 1 (got 0)"]),
    ("world-vs-tpxppxcp", 6, CP2 + ["--tensor-model-parallel-size", "2"],
     ["world size 6 is not divisible by", "--context-parallel-size (2) = 4"]),
    ("context-parallel-seq-length", 2, CP2 + ["--seq-length", "126"],
     ["--seq-length (126) is not divisible by 2 x --context-parallel-size (2) = 4"]),
    ("context-parallel-sequence-parallel", 8, CP2 + ["--tensor-model-parallel-size", "4", "--sequence-parallel",
                                                     "--seq-length", "20"],
     ["--sequence-parallel with --context-parallel-size 2", "each CP rank's 10 tokens", "(4)"]),
    ("context-parallel-local-layers", 2, CP2 + TE, ["--context-parallel-size 2", "--transformer-impl local"]),
    ("context-parallel-attention-dropout", 2, MOCK + ["--context-parallel-size", "2"],
     ["--context-parallel-size 2 with --attention-dropout 0.1", "add --attention-dropout 0"]),
    ("context-parallel-attention-backend", 2, CP2 + ["--attention-backend", "flash", "--bf16"],
     ["--context-parallel-size 2 with --attention-backend flash", "(auto)", "local, unfused"]),
    ("hidden-vs-heads", 1, MOCK + ["--hidden-size", "100", "--num-attention-heads", "3"],
     ["--hidden-size (100) is not divisible by --num-attention-heads (3)"]),
    ("hidden-vs-tp", 2, MOCK + ["--tensor-model-parallel-size", "2", "--hidden-size", "33",
                                "--num-attention-heads", "11"],
     ["--hidden-size (33) is not divisible by --tensor-model-parallel-size (2)"]),
    ("heads-vs-tp", 2, MOCK + ["--tensor-model-parallel-size", "2", "--hidden-size", "96",
                               "--num-attention-heads", "3"],
     ["--num-attention-heads (3) is not divisible by --tensor-model-parallel-size (2)"]),
    ("ffn-vs-tp", 2, MOCK + ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "63"],
     ["MLP hidden size (63) is not divisible by --tensor-model-parallel-size (2)"]),
    ("rope-even-head-dim", 1, MOCK + ["--position-embedding-type", "rope", "--hidden-size", "12",
                                      "--num-attention-heads", "4"], ["RoPE needs an even number of rotated dim"]),
    ("rope-even-head-dim/rotary-percent", 1, MOCK + ["--position-embedding-type", "rope", "--rotary-percent", "0.25",
                                            "--kv-channels", "12"], ["head dimension 12 x --rotary-percent 0.25 = 3"]),
    ("kv-channels>=1", 1, MOCK + ["--kv-channels", "0"], ["--kv-channels must be >= 1 (got 0)"]),
    ("query-groups-divide-heads", 1, MOCK + ["--group-query-attention", "--num-query-groups", "3"],
     ["--num-query-groups (3) must divide --num-attention-heads (4)"]),
    ("query-groups-vs-tp", 2, MOCK + ["--group-query-attention", "--tensor-model-parallel-size", "2"],
     ["--num-query-groups (1) is not divisible by --tensor-model-parallel-size (2)"]),
    ("rotary-interpolation>=1", 1, MOCK + ["--rotary-seq-len-interpolation-factor", "0"],
     ["--rotary-seq-len-interpolation-factor must be >= 1 (got 0)"]),
    ("rope-scaling-needs-rope", 1, MOCK + ["--use-rope-scaling"],
     ["--use-rope-scaling applies to --position-embedding-type rope, not learned_absolute"]),
    ("rope-scaling-factor>=1", 1, MOCK + ["--position-embedding-type", "rope", "--use-rope-scaling",
                                          "--rope-scaling-factor", "0.5"],
     ["--rope-scaling-factor must be a finite number >= 1 (got 0.5)"]),
    ("rope-scaling-factor-needs-scaling", 1, MOCK + ["--position-embedding-type", "rope", "--rope-scaling-factor", "32"],
     ["--rope-scaling-factor 32.0 has no effect without --use-rope-scaling"]),
    ("rotary-percent-range", 1, MOCK + ["--rotary-percent", "1.5"], ["--rotary-percent must be in (0, 1] (got 1.5)"]),
    ("no-position-embedding-learned", 1, MOCK + ["--no-position-embedding"],
     ["--no-position-embedding with --position-embedding-type learned_absolute"]),
    ("attention-backend-needs-half", 1, MOCK + ["--attention-backend", "fused"],
     ["--attention-backend fused runs half-precision kernels: add --bf16 or --fp16"]),
    ("attention-backend-needs-cuda", 1, MOCK + ["--attention-backend", "flash", "--bf16"],
     ["--attention-backend flash needs a CUDA device"]),
    ("seq-vs-positions", 1, MOCK + ["--seq-length", "512", "--max-position-embeddings", "256"],
     ["--seq-length (512) exceeds --max-position-embeddings (256)"]),
    ("dropout-range", 1, MOCK + ["--hidden-dropout", "1.0"], ["dropout probabilities must be in [0, 1)"]),
    # activation recomputation
    ("recompute-activations-vs-full", 1, MOCK + ["--recompute-activations", "--recompute-granularity", "full"],
     ["--recompute-activations means --recompute-granularity selective", "contradicts --recompute-granularity full"]),
    ("recompute-full-needs-method", 1, MOCK + ["--recompute-granularity", "full", "--recompute-num-layers", "1"],
     ["--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers"]),
    ("recompute-num-layers>=1", 1, MOCK + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                           "--recompute-num-layers", "0"],
     ["--recompute-num-layers must be >= 1 (got 0)"]),
    ("recompute-method-needs-full", 1, MOCK + ["--recompute-activations", "--recompute-method", "block"],
     ["--recompute-method and --recompute-num-layers apply to --recompute-granularity full, not selective"]),
    ("sequence-parallel-seq", 2, MOCK + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                         "--seq-length", "63"], ["--sequence-parallel", "--seq-length (63)"]),
    ("virtual-stage>=1", 2, MOCK + ["--pipeline-model-parallel-size", "2",
                                    "--num-layers-per-virtual-pipeline-stage", "0"],
     ["--num-layers-per-virtual-pipeline-stage must be >= 1"]),
    ("layers-vs-stages-x-chunks", 2, MOCK + ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                             "--num-layers-per-virtual-pipeline-stage", "3"],
     ["--num-layers (4)", "--pipeline-model-parallel-size (2) x --num-layers-per-virtual-pipeline-stage (3)"]),
    ("layers-vs-stages", 2, MOCK + ["--pipeline-model-parallel-size", "2", "--num-layers", "3"],
     ["--num-layers (3) is not divisible by --pipeline-model-parallel-size (2)"]),
    ("layers-vs-stages/counted", 2, MOCK + ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                            "--account-for-loss-in-pipeline-split"],
     ["--num-layers (4) + 1 (--account-for-loss-in-pipeline-split) is not divisible by "
      "--pipeline-model-parallel-size"]),
    # uneven pipeline splits (megatron_po/layer_split.py)
    ("uneven-split-needs-pp", 1, MOCK + ["--decoder-last-pipeline-num-layers", "1"],
     ["--decoder-last-pipeline-num-layers", "needs --pipeline-model-parallel-size > 1"]),
    ("layout-alone", 2, PP2 + ["--pipeline-model-parallel-layout", "Et|tL", "--decoder-first-pipeline-num-layers", "1"],
     ["--pipeline-model-parallel-layout", "drop --decoder-first-pipeline-num-layers"]),
    ("layout-alone/virtual-stages", 2, PP2 + ["--pipeline-model-parallel-layout", "Et|tL",
                                              "--num-layers-per-virtual-pipeline-stage", "1"],
     ["--pipeline-model-parallel-layout", "drop --num-layers-per-virtual-pipeline-stage"]),
    ("uneven-split-vs-virtual-stages", 2, PP2 + ["--num-layers", "4", "--decoder-first-pipeline-num-layers", "2",
                                                 "--num-layers-per-virtual-pipeline-stage", "1"],
     ["--decoder-first-pipeline-num-layers with --num-layers-per-virtual-pipeline-stage",
      "give --num-virtual-stages-per-pipeline-rank"]),
    ("one-virtual-stage-flag", 2, PP2 + ["--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2",
                                         "--num-layers-per-virtual-pipeline-stage", "1"],
     ["--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank", "give one of them"]),
    ("virtual-stages>=1", 2, PP2 + ["--num-virtual-stages-per-pipeline-rank", "0"],
     ["--num-virtual-stages-per-pipeline-rank must be >= 1 (got 0)"]),
    ("layout-alone/virtual-stages-per-rank", 2, PP2 + ["--pipeline-model-parallel-layout", "Et|tL",
                                                       "--num-virtual-stages-per-pipeline-rank", "1"],
     ["drop --num-virtual-stages-per-pipeline-rank"]),
    ("layers-vs-stages-x-virtual-stages", 2, PP2 + ["--num-layers", "6", "--num-virtual-stages-per-pipeline-rank",
                                                    "2"],
     ["--num-layers (6) is not divisible by --pipeline-model-parallel-size (2) x "
      "--num-virtual-stages-per-pipeline-rank (2)"]),
    ("pipeline-split/chunks", 2, PP2 + ["--num-layers", "8", "--decoder-first-pipeline-num-layers", "3",
                                        "--num-virtual-stages-per-pipeline-rank", "2"],
     ["pipeline rank 0's 3 layers (--decoder-first-pipeline-num-layers) do not split evenly over its 2 model "
      "chunks"]),
    ("layout-grammar", 2, PP2 + ["--pipeline-model-parallel-layout", "Ex|tL"],
     ["--pipeline-model-parallel-layout 'Ex|tL': unknown layer letter(s) x"]),
    ("layout-stages-vs-pp", 2, PP2 + ["--pipeline-model-parallel-layout", "Et|t|L"],
     ["--pipeline-model-parallel-layout 'Et|t|L' names 3 virtual stages, not a multiple of "
      "--pipeline-model-parallel-size (2)"]),
    ("pipeline-split", 2, PP2 + ["--num-layers", "4", "--decoder-first-pipeline-num-layers", "5"],
     ["--decoder-first-pipeline-num-layers (5) = 5 layers; --num-layers is 4"]),
    ("pipeline-split/zero", 2, PP2 + ["--num-layers", "4", "--decoder-last-pipeline-num-layers", "0"],
     ["--decoder-last-pipeline-num-layers must be >= 1, as Megatron (got 0)", "--pipeline-model-parallel-layout"]),
    ("pipeline-split/middle", 4, MOCK + ["--pipeline-model-parallel-size", "4", "--num-layers", "8",
                                         "--decoder-first-pipeline-num-layers", "3",
                                         "--decoder-last-pipeline-num-layers", "2"],
     ["the 3 layers left by --decoder-first-pipeline-num-layers (3) + --decoder-last-pipeline-num-layers (2) do not "
      "split evenly over the other 2 pipeline stages"]),
    ("pipeline-split/empty-stage", 4, MOCK + ["--pipeline-model-parallel-size", "4", "--num-layers", "4",
                                              "--decoder-first-pipeline-num-layers", "2",
                                              "--decoder-last-pipeline-num-layers", "2"],
     ["leave virtual stage 1 without a transformer layer", "refused here"]),
    ("pipeline-split/layout-count", 2, PP2 + ["--pipeline-model-parallel-layout", "Et|tttL"],
     ["--pipeline-model-parallel-layout 'Et|tttL' places 4 transformer layers t; --num-layers is 2"]),
    ("pipeline-split/layout-embedding", 2, PP2 + ["--pipeline-model-parallel-layout", "tE|tL"],
     ["the embedding E comes once, first on virtual stage 0"]),
    ("pipeline-split/layout-loss", 2, PP2 + ["--pipeline-model-parallel-layout", "Et|Lt"],
     ["the loss L comes once, last on the last virtual stage"]),
    ("pipeline-split/layout-empty", 4, MOCK + ["--pipeline-model-parallel-size", "2", "--num-layers", "2",
                                               "--pipeline-model-parallel-layout", "Et||t|L"],
     ["virtual stage 1 holds nothing", "refused here"]),
    ("pipeline-split/layout-mtp-count", 2, PP2 + MTP + ["--pipeline-model-parallel-layout", "Et|tL"],
     ["places 0 MTP depths m; --mtp-num-layers is 1"]),
    ("pipeline-split/layout-standalone-mtp", 2, PP2 + MTP + ["--pipeline-model-parallel-layout", "Etm|tL"],
     ["the MTP depths m go on the last virtual stage after its transformer layers",
      "standalone MTP stage is not built here"]),
    ("pipeline-split/account-with-uneven", 2, PP2 + ["--decoder-first-pipeline-num-layers", "1",
                                                     "--account-for-embedding-in-pipeline-split"],
     ["--account-for-embedding-in-pipeline-split", "Megatron takes no standalone embedding or loss stage with an "
                                                   "uneven split"]),
    ("global-batch-vs-micro-x-dp", 2, MOCK + ["--micro-batch-size", "3", "--global-batch-size", "8"],
     ["--global-batch-size (8) is not divisible by --micro-batch-size (3) x data-parallel size (2)"]),
    ("interleaving-microbatches", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--num-layers", "4",
                                                  "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size",
                                                  "4", "--global-batch-size", "12"],
     ["--pipeline-method pipeoptim with an interleaved pipeline", "micro-batches (3",
      "--pipeline-model-parallel-size (2)", "synchronous interleaved schedules take any number"]),
    ("zb-v-two-chunks", 2, PP2_ASYNC + ["--num-layers", "4", "--pipeline-method", "zb-v"],
     ["--pipeline-method zb-v runs 2 model chunks per rank", "--num-layers-per-virtual-pipeline-stage", "= 1"]),
    ("zb-v-untied", 2, MOCK + ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                               "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-method", "zb-v",
                               "--micro-batch-size", "1", "--global-batch-size", "4"],
     ["--pipeline-method zb-v", "--untie-embeddings-and-output-weights"]),
    ("zb-h2-one-chunk", 2, MOCK + ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                   "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-method", "zb-h2",
                                   "--micro-batch-size", "1", "--global-batch-size", "4"],
     ["--pipeline-method zb-h2 runs one model chunk per rank", "zb-h1"]),
    # learning rate
    ("min-lr<=lr", 1, MOCK + ["--lr", "0.1", "--min-lr", "1.0"], ["--min-lr (1.0) <= --lr (0.1)"]),
    ("warmup>=0", 1, MOCK + ["--lr-warmup-iters", "-1"], ["--lr-warmup-iters must be >= 0"]),
    # data and tokenizer
    ("mock-needs-vocab", 1, ["--mock-data", "--tokenizer-type", "NullTokenizer"], ["--mock-data needs --vocab-size"]),
    ("data-path-required", 1, ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
     ["--data-path is required"]),
    ("data-path-format/pairs", 1, ["--data-path", "0.3", "A", "0.7", "--tokenizer-model", "t.model"],
     ["--data-path 0.3 A 0.7: weights and prefixes must alternate"]),
    ("data-path-format/weight", 1, ["--data-path", "x", "A", "0.7", "B", "--tokenizer-model", "t.model"],
     ["--data-path x A 0.7 B: weight 'x' is not a number"]),
    ("data-path-format/finite", 1, ["--data-path", "inf", "A", "0.7", "B", "--tokenizer-model", "t.model"],
     ["--data-path weights [inf, 0.7] must be non-negative with a positive sum"]),
    ("split-format", 1, ["--data-path", "A", "--tokenizer-model", "t.model", "--split", "a,b"], ["--split 'a,b'"]),
    ("tokenizer-flags/sentencepiece", 1, ["--data-path", "A"],
     ["--tokenizer-type SentencePieceTokenizer needs --tokenizer-model"]),
    ("tokenizer-flags/null", 1, ["--data-path", "A", "--tokenizer-type", "NullTokenizer"],
     ["--tokenizer-type NullTokenizer needs --vocab-size"]),
    ("tokenizer-flags/gpt2-bpe", 1, ["--data-path", "A", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v"],
     ["--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt)"]),
    ("mock-data-xor-data-path", 1, MOCK + ["--data-path", "A"],
     ["--mock-data and --data-path A exclude each other"]),
    # precision
    ("fp16-xor-bf16", 1, MOCK + ["--fp16", "--bf16"], ["--fp16 and --bf16 are mutually exclusive"]),
    ("loss-scale-needs-fp16", 1, MOCK + ["--loss-scale", "8"], ["--loss-scale 8.0 applies only to --fp16"]),
    ("loss-scale>0", 1, MOCK + ["--fp16", "--loss-scale", "0"], ["--loss-scale must be > 0"]),
    ("initial-loss-scale>0", 1, MOCK + ["--initial-loss-scale", "0"], ["--initial-loss-scale must be > 0"]),
    ("min-loss-scale>0", 1, MOCK + ["--min-loss-scale", "0"], ["--min-loss-scale must be > 0"]),
    ("min-vs-initial-loss-scale", 1, MOCK + ["--min-loss-scale", "8", "--initial-loss-scale", "4"],
     ["--min-loss-scale (8.0) exceeds --initial-loss-scale (4.0)"]),
    ("loss-scale-window>=1", 1, MOCK + ["--loss-scale-window", "0"], ["--loss-scale-window must be an integer >= 1"]),
    ("hysteresis>=1", 1, MOCK + ["--hysteresis", "0"], ["--hysteresis must be an integer >= 1"]),
    ("overlap-needs-distopt", 1, MOCK + ["--overlap-param-gather"],
     ["--overlap-param-gather requires --use-distributed-optimizer"]),
    # asynchronous methods
    ("async-no-overlap-gather", 2, PP2_ASYNC + ["--pipeline-method", "pipedream", "--use-distributed-optimizer",
                                                "--overlap-param-gather"],
     ["--overlap-param-gather applies to the synchronous methods, pipeoptim and spectrain", "--pipeline-method pipedream"]),
    ("async-interval>=1", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--async-update-interval", "0"],
     ["--async-update-interval must be >= 1"]),
    ("async-needs-untied", 2, MOCK + ["--pipeline-model-parallel-size", "2", "--pipeline-method", "pipeoptim"],
     ["--pipeline-method pipeoptim is asynchronous", "--untie-embeddings-and-output-weights"]),
    ("async-interval-divides-microbatches", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--async-update-interval",
                                                            "3", "--global-batch-size", "8"],
     ["--async-update-interval (3) must divide the micro-batches per iteration (2)"]),
    ("spectrain-needs-sgd", 2, PP2_ASYNC + ["--pipeline-method", "spectrain"],
     ["--pipeline-method spectrain", "--optimizer sgd", "--sgd-momentum > 0", "adamw"]),
    ("spectrain-needs-sgd/momentum", 2, PP2_ASYNC + ["--pipeline-method", "spectrain", "--optimizer", "sgd",
                                                 "--sgd-momentum", "0"], ["--pipeline-method spectrain"]),
    ("2bw-interval>=stages", 2, PP2_ASYNC + ["--pipeline-method", "pipedream-2bw", "--async-update-interval", "1"],
     ["--async-update-interval (1) must be >= --pipeline-model-parallel-size (2)"]),
    # The layout sweep's finding (tools/layout_sweep.py): accepted, then refused by the policy after the groups.
    ("2bw-interleaved-staleness", 4, MOCK + ["--pipeline-model-parallel-size", "4", "--untie-embeddings-and-output-weights",
                                             "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1",
                                             "--pipeline-method", "pipedream-2bw", "--async-update-interval", "4",
                                             "--global-batch-size", "16"],
     ["--pipeline-method pipedream-2bw", "interleaved over 2 chunks", "--async-update-interval 4",
      "spans 2 steps"]),
    ("weight-predictor-needs-pipeoptim", 2, PP2_ASYNC + ["--pipeline-method", "pipedream",
                                                       "--weight-predictor", "rollout"],
     ["--weight-predictor applies to --pipeline-method pipeoptim, not pipedream"]),
    ("rollout-gradient-needs-rollout", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--rollout-gradient",
                                                       "zero-mean"],
     ["--rollout-gradient applies to --weight-predictor rollout"]),
    ("rollout-optimizers", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--weight-predictor", "rollout",
                                           "--optimizer", "lion"],
     ["--weight-predictor rollout", "not --optimizer lion"]),
    ("rollout-sgd-buffer", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--weight-predictor", "rollout",
                                           "--optimizer", "sgd", "--pipeoptim-sgd-direction", "lookahead"],
     ["--weight-predictor rollout with --optimizer sgd", "--pipeoptim-sgd-direction buffer"]),
    ("delay-compensation>=0", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--delay-compensation-lambda", "-1"],
     ["--delay-compensation-lambda must be >= 0"]),
    ("delay-compensation-methods", 2, PP2_ASYNC + ["--pipeline-method", "async-naive", "--delay-compensation-lambda",
                                                   "0.1"], ["--delay-compensation-lambda", "not async-naive"]),
    ("delay-compensation-k1", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--delay-compensation-lambda", "0.1",
                                              "--async-update-interval", "2", "--global-batch-size", "8"],
     ["--async-update-interval 1 (got 2)"]),
    ("delay-compensation-no-distopt", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--delay-compensation-lambda",
                                                      "0.1", "--use-distributed-optimizer"],
     ["--delay-compensation-lambda", "drop --use-distributed-optimizer"]),
    ("adaptive-needs-lambda", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--delay-compensation-adaptive"],
     ["--delay-compensation-adaptive needs --delay-compensation-lambda > 0"]),
    ("nadam-momentum-decay>=0", 1, MOCK + ["--nadam-momentum-decay", "-1"], ["--nadam-momentum-decay must be >= 0"]),
    ("pipenag-needs-nag", 2, PP2_ASYNC + ["--pipeline-method", "pipenag"],
     ["--pipeline-method pipenag", "--optimizer nag (got --optimizer adamw)"]),
    ("pipenag-fp32", 2, PP2_ASYNC + ["--pipeline-method", "pipenag", "--optimizer", "nag", "--bf16"],
     ["--pipeline-method pipenag", "drop --bf16/--fp16/--use-distributed-optimizer"]),
    ("error-feedback-fp32", 2, PP2_ASYNC + ["--pipeline-method", "pipedream", "--async-error-feedback",
                                            "--use-distributed-optimizer"],
     ["--async-error-feedback", "drop --bf16/--fp16/--use-distributed-optimizer"]),
    ("staleness-lr-scaling-needs-async", 1, MOCK + ["--staleness-lr-scaling", "inverse"],
     ["--staleness-lr-scaling applies to asynchronous pipeline methods, not --pipeline-method 1f1b"]),
    ("interval-needs-async", 1, MOCK + ["--async-update-interval", "2"],
     ["--async-update-interval applies to asynchronous methods, not --pipeline-method 1f1b"]),
    ("drain-interval>=1", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--async-drain-interval", "0"],
     ["--async-drain-interval must be >= 1 (got 0)"]),
    ("save-on-drains", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--async-drain-interval", "4", "--save", "c",
                                       "--save-interval", "6"],
     ["--save-interval (6) must be a multiple of --async-drain-interval (4)"]),
    ("drain-interval-needs-async", 1, MOCK + ["--async-drain-interval", "2"],
     ["--async-drain-interval applies to asynchronous methods, not --pipeline-method 1f1b"]),
    # checkpoints
    ("save-interval-needs-save", 1, MOCK + ["--save-interval", "5"], ["--save-interval needs --save"]),
    ("save-interval>=1", 1, MOCK + ["--save", "ck", "--save-interval", "0"], ["--save-interval must be >= 1"]),
    ("keep-last-needs-save", 1, MOCK + ["--keep-last", "2"], ["--keep-last needs --save"]),
    ("keep-last>=1", 1, MOCK + ["--save", "ck", "--keep-last", "0"], ["--keep-last must be >= 1"]),
    ("ckpt-step-needs-load", 1, MOCK + ["--ckpt-step", "3"], ["--ckpt-step needs --load"]),
    ("finetune-needs-load", 1, MOCK + ["--finetune"], ["--finetune needs --load"]),
    ("ckpt-step>=0", 1, MOCK + ["--load", "ck", "--ckpt-step", "-1"], ["--ckpt-step must be >= 0"]),
    # Megatron's sample-counted schedule
    ("train-samples>=1", 1, MOCK + ["--train-samples", "0"], ["--train-samples must be >= 1 (got 0)"]),
    ("train-samples-xor-iters", 1, MOCK + ["--train-samples", "10", "--train-iters", "5"],
     ["--train-samples and --train-iters exclude each other"]),
    ("lr-decay-iters-vs-train-samples", 1, MOCK + ["--train-samples", "10", "--lr-decay-iters", "5"],
     ["--lr-decay-iters counts iterations: with --train-samples use its -samples twin"]),
    ("lr-warmup-samples-needs-train-samples", 1, MOCK + ["--lr-warmup-samples", "5"],
     ["--lr-warmup-samples counts samples: it needs --train-samples"]),
    ("lr-decay-samples>=0", 1, MOCK + ["--train-samples", "10", "--lr-decay-samples", "-1"],
     ["--lr-decay-samples must be >= 0 (got -1)"]),
    ("wsd-samples-need-wsd", 1, MOCK + ["--train-samples", "10", "--lr-wsd-decay-samples", "5"],
     ["--lr-wsd-decay-samples applies to --lr-decay-style wsd, not cosine"]),
    ("warmup-fraction-range", 1, MOCK + ["--lr-warmup-fraction", "1.5"], ["--lr-warmup-fraction must be in [0, 1]"]),
    ("warmup-fraction-xor", 1, MOCK + ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
     ["--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples exclude each other"]),
    ("decoupled-min-needs-lr", 1, MOCK + ["--decoupled-min-lr", "1e-5"], ["--decoupled-min-lr needs --decoupled-lr"]),
    ("decoupled-order", 1, MOCK + ["--decoupled-lr", "1e-5", "--decoupled-min-lr", "1e-4"],
     ["need 0 <= --decoupled-min-lr (0.0001) <= --decoupled-lr (1e-05)"]),  # checked before the not-yet rule
    ("rampup-positive", 1, MOCK + ["--rampup-batch-size", "0", "4", "10"], ["START >= 1, INCR >= 1, SAMPLES >= 0"]),
    ("rampup-reaches-gbs", 1, MOCK + ["--rampup-batch-size", "4", "8", "10", "--global-batch-size", "16"],
     ["--global-batch-size (16) must be START (4) plus a multiple of INCR (8)"]),
    ("rampup-whole-microbatches", 1, MOCK + ["--rampup-batch-size", "2", "2", "10", "--global-batch-size", "16"],
     ["START (2) and INCR (2) must be multiples of --micro-batch-size x data-parallel size (4)"]),
    ("rampup-sync-only", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--rampup-batch-size", "4", "4", "10",
                                         "--global-batch-size", "8"],
     ["--rampup-batch-size changes the micro-batches per iteration", "pipeoptim"]),
    # Megatron switches
    ("reset-attention-mask-needs-local", 1, MOCK + TE + ["--reset-attention-mask"],
     ["--reset-attention-mask needs --transformer-impl local"]),
    ("decoupled-lr-sync-only", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--decoupled-lr", "1e-3"],
     ["--decoupled-lr is wired for the synchronous methods", "pipeoptim"]),
    ("exit-duration>0", 1, MOCK + ["--exit-duration-in-mins", "0"], ["--exit-duration-in-mins must be > 0"]),
    ("manual-gc-interval>=0", 1, MOCK + ["--manual-gc", "--manual-gc-interval", "-1"],
     ["--manual-gc-interval must be >= 0"]),
    ("manual-gc-interval-needs-gc", 1, MOCK + ["--manual-gc-interval", "5"], ["--manual-gc-interval needs --manual-gc"]),
    ("tensorboard-interval>=1", 1, MOCK + ["--tensorboard-log-interval", "0"],
     ["--tensorboard-log-interval must be >= 1"]),
    ("profile-steps", 1, MOCK + ["--profile", "--profile-step-start", "5", "--profile-step-end", "5"],
     ["--profile needs 1 <= --profile-step-start (5) < --profile-step-end (5)"]),
    ("grad-reduce-bf16-needs-bf16", 1, MOCK + ["--grad-reduce-in-bf16"], ["--grad-reduce-in-bf16 needs --bf16"]),
    ("nccl-needs-cuda", 1, MOCK + ["--distributed-backend", "nccl"], ["--distributed-backend nccl needs CUDA"]),
    ("grad-reduce-bf16-vs-fp32", 1, MOCK + ["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"],
     ["--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict"]),
    ("fp8-param-gather", 1, MOCK + ["--fp8-param-gather"], ["--fp8-param-gather", "not implemented here"]),
    ("log-params-norm-sync-only", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--log-params-norm"],
     ["--log-params-norm is logged by the synchronous methods"]),
    ("tiktoken-pattern", 1, MOCK + ["--tiktoken-pattern", "v2"], ["--tiktoken-pattern v2", "TikTokenizer"]),
    # the Megatron recipes' launcher and logging flags (config_recipe_rules.py)
    ("lr-warmup-init-range", 1, MOCK + ["--lr", "1e-4", "--lr-warmup-init", "1e-3"],
     ["--lr-warmup-init (0.001) must be in [0, --lr (0.0001)]"]),
    ("lr-warmup-init-range/negative", 1, MOCK + ["--lr-warmup-init", "-1e-5"], ["--lr-warmup-init (-1e-05)"]),
    ("logging-level>=0", 1, MOCK + ["--logging-level", "-1"], ["--logging-level must be >= 0 (got -1", "40 ERROR"]),
    ("tensorboard-queue-size>=1", 1, MOCK + ["--tensorboard-queue-size", "0"],
     ["--tensorboard-queue-size must be >= 1 (got 0)"]),
    ("padded-vocab-size-divides-by-tp", 2, MOCK + ["--tensor-model-parallel-size", "2", "--padded-vocab-size", "129"],
     ["--padded-vocab-size (129) is not divisible by --tensor-model-parallel-size (2)"]),
    ("padded-vocab-size-holds-vocab", 1, MOCK + ["--padded-vocab-size", "100"],
     ["--padded-vocab-size (100) is smaller than the tokenizer's vocabulary (101)"]),  # NullTokenizer: + its EOD
    ("dist-ckpt-strictness-return", 1, MOCK + ["--dist-ckpt-strictness", "return_all"],
     ["--dist-ckpt-strictness return_all hands the mismatched keys to a Python caller", "log_all"]),
    # --use-precision-aware-optimizer and its dtype flags, CPU offload, --recompute-modules, CUDA graphs
    *[(f"{flag[2:]}-needs-precision-aware", 1, MOCK + [flag, "bf16"],
       [f"{flag} other than fp32 needs --use-precision-aware-optimizer"])
      for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype", "--main-grads-dtype")],
    ("main-params-dtype-needs-precision-aware", 1, MOCK + ["--main-params-dtype", "fp16"],
     ["--main-params-dtype other than fp32 needs --use-precision-aware-optimizer"]),
    ("precision-aware-adam", 1, MOCK + ["--use-precision-aware-optimizer", "--optimizer", "muon"],
     ["--use-precision-aware-optimizer holds Adam's state", "not muon"]),
    *[(f"{flag[2:]}-fp8-refused", 1, MOCK + ["--use-precision-aware-optimizer", flag, "fp8"],
       [f"{flag} fp8", "not implemented here"]) for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype")],
    ("main-params-dtype-fp16-refused", 1, MOCK + ["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"],
     ["--main-params-dtype fp16 is not implemented here"]),
    ("main-grads-dtype-bf16-needs-bf16", 1, MOCK + ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"],
     ["--main-grads-dtype bf16 needs --bf16"]),
    ("main-grads-dtype-bf16-vs-fp32", 1, MOCK + ["--bf16", "--accumulate-allreduce-grads-in-fp32",
                                                 "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"],
     ["--main-grads-dtype bf16 and --accumulate-allreduce-grads-in-fp32 contradict"]),
    ("main-grads-dtype-bf16-fsdp2", 2, MOCK + ["--bf16", "--use-torch-fsdp2", "--use-precision-aware-optimizer",
                                                "--main-grads-dtype", "bf16"],
     ["--main-grads-dtype bf16 under FSDP2: add --grad-reduce-in-bf16"]),
    ("optimizer-cpu-offload-needs-precision-aware", 1, MOCK + ["--optimizer-cpu-offload"],
     ["--optimizer-cpu-offload needs --use-precision-aware-optimizer"]),
    ("optimizer-cpu-offload-gpu", 1, MOCK + ["--use-precision-aware-optimizer", "--optimizer-cpu-offload"],
     ["--optimizer-cpu-offload on a GPU", "not implemented here"]),
    ("optimizer-offload-fraction-range", 1, MOCK + ["--optimizer-offload-fraction", "1.5"],
     ["--optimizer-offload-fraction (1.5) must be in [0, 1]"]),
    ("recompute-modules", 1, MOCK + ["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                                     "moe_act", "layernorm"], ["--recompute-modules moe_act layernorm: not implemented "
                                                               "here", "core_attn, mlp, moe, shared_experts"]),
    ("recompute-modules-mlp-local", 1, MOCK + TE + ["--recompute-activations", "--recompute-modules", "mlp"],
     ["--recompute-modules mlp", "--transformer-impl local"]),
    ("recompute-modules/unknown", 1, MOCK + ["--recompute-activations", "--recompute-modules", "attention"],
     ["--recompute-modules attention: not Megatron's module names"]),
    ("cuda-graph-scope", 1, MOCK + ["--cuda-graph-scope", "attn", "layers"], ["--cuda-graph-scope attn layers",
                                                                           "moe_router"]),
    ("calculate-per-token-loss-sync-only", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--calculate-per-token-loss"],
     ["--calculate-per-token-loss", "--pipeline-method pipeoptim"]),
    ("no-save-optim-needs-save", 1, MOCK + ["--no-save-optim"], ["--no-save-optim needs --save"]),
    ("use-checkpoint-args-needs-load", 1, MOCK + ["--use-checkpoint-args"], ["--use-checkpoint-args needs --load"]),
    # FSDP2 (distributed/fsdp.py)
    ("fsdp-no-distopt", 2, MOCK + ["--use-torch-fsdp2", "--use-distributed-optimizer"],
     ["--use-torch-fsdp2", "drop --use-distributed-optimizer"]),
    ("fsdp-no-distopt/strategy", 2, MOCK + ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim"],
     ["--use-torch-fsdp2", "--data-parallel-sharding-strategy optim"]),
    ("fsdp-local-layers", 2, MOCK + TE + ["--data-parallel-sharding-strategy", "optim_grads_params"],
     ["optim_grads_params", "--transformer-impl transformer_engine", "use --transformer-impl local"]),
    ("fsdp-async-reshards", 2, PP2_ASYNC + ["--pipeline-method", "pipedream", "--use-torch-fsdp2",
                                            "--torch-fsdp2-no-reshard-after-forward"],
     ["--pipeline-method pipedream under FSDP2", "drop --torch-fsdp2-no-reshard-after-forward"]),
    ("fsdp-async-reshards/optim-grads", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim",
                                                        "--data-parallel-sharding-strategy", "optim_grads"],
     ["--pipeline-method pipeoptim under FSDP2", "optim_grads"]),
    ("fsdp-async-recompute", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--use-torch-fsdp2",
                                             "--recompute-granularity", "selective"],
     ["--recompute-granularity with --pipeline-method pipeoptim under FSDP2", "pipedream-2bw"]),
    # The layout sweep's finding: MoE-layer recomputation too (PipeOptim on FSDP2 3.6e-5 off its emulator).
    ("fsdp-async-recompute/moe-layer", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--use-torch-fsdp2",
                                                       "--num-experts", "4", "--moe-layer-recompute"],
     ["--moe-layer-recompute with --pipeline-method pipeoptim under FSDP2", "live shards"]),
    ("fsdp-delay-compensation", 2, PP2_ASYNC + ["--pipeline-method", "pipedream", "--use-torch-fsdp2",
                                                "--delay-compensation-lambda", "0.1"],
     ["--delay-compensation-lambda", "--use-torch-fsdp2"]),
    # FP8: backend and recipe (models/fp8.py; more cases, the GPU capability among them, in tests/test_fp8.py)
    ("fp8-flags-need-format", 1, MOCK + ["--fp8-recipe", "rowwise"], ["--fp8-recipe applies to FP8 training",
                                                                      "add --fp8-format hybrid"]),
    ("fp8-flags-need-format/backend", 1, MOCK + ["--fp8-backend", "torchao"], ["--fp8-backend applies to FP8"]),
    ("fp8-not-fp16", 1, MOCK + ["--fp8-format", "hybrid", "--fp16"], ["--fp8-format hybrid with --fp16", "--bf16"]),
    ("fp8-te-needs-te-impl", 1, MOCK + ["--fp8-format", "hybrid", "--fp8-backend", "te"],
     ["--fp8-backend te", "add --transformer-impl transformer_engine"]),
    ("fp8-torchao-needs-local", 1, TE_FP8 + ["--fp8-backend", "torchao"],
     ["--fp8-backend torchao", "needs --transformer-impl local"]),
    ("fp8-recipe-vs-backend", 1, MOCK + ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
     ["--fp8-recipe delayed is not available with --fp8-backend torchao", "tensorwise, rowwise"]),
    ("fp8-recipe-vs-backend/te", 1, TE_FP8 + ["--fp8-recipe", "tensorwise"],
     ["--fp8-recipe tensorwise is not available with --fp8-backend te", "runs delayed here"]),
    ("fp8-rowwise-e4m3", 1, MOCK + ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
     ["--fp8-recipe rowwise", "use --fp8-format e4m3"]),
    ("fp8-dims-by-16", 2, MOCK + ["--fp8-format", "hybrid", "--tensor-model-parallel-size", "2", "--hidden-size", "80",
                                  "--num-attention-heads", "4", "--seq-length", "12", "--micro-batch-size", "2"],
     ["divisible by 16; not: QKV outputs per TP rank 120, attention-projection inputs per TP rank 40, ",
      "tokens per micro-batch (--seq-length x --micro-batch-size) 24"]),
    ("fp8-gpu-capability", 1, MOCK + ["--fp8-format", "hybrid"],
     ["needs a GPU of compute capability >= 8.9", "(NVIDIA A100) is 8.0"]),
    # Transformer Engine (the FP8 rules come before the import, so they hold without TE)
    ("fp8-amax-history>=1", 1, TE_FP8 + ["--fp8-amax-history-len", "0"],
     ["--fp8-amax-history-len must be >= 1 (got 0)"]),
    ("fp8-margin>=0", 1, TE_FP8 + ["--fp8-margin", "-1"], ["--fp8-margin must be >= 0 (got -1)"]),
    ("te-no-qk-layernorm", 1, MOCK + TE + ["--qk-layernorm"], ["--qk-layernorm is not wired into the Transformer"]),
    ("fp8-sizes-by-16", 2, TE_FP8 + ["--tensor-model-parallel-size", "2", "--hidden-size", "48"],
     ["--fp8-format needs --hidden-size (48) and the hidden and MLP sizes per TP rank (24, 96) divisible by 16"]),
    ("fp8-tokens-by-8", 1, TE_FP8 + ["--seq-length", "6", "--micro-batch-size", "1"],
     ["--fp8-format needs the tokens of a micro-batch per rank (6: sequence 6 x --micro-batch-size 1) divisible by 8"]),
    ("fp8-no-full-recompute", 1, TE_FP8 + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                           "--recompute-num-layers", "1"],
     ["--recompute-granularity full with --fp8-format is not supported", "use --recompute-granularity selective"]),
    ("te-no-torch-compile", 1, MOCK + TE + ["--torch-compile"],
     ["--torch-compile compiles the local transformer layers", "use one or the other"]),
    ("te-importable", 1, MOCK + TE,
     ["Transformer Engine requested but not usable: ", "--transformer-impl local runs without it"]),
    # one rule per flag of a family (the families above have a row for one of their flags)
    *[(f"{flag[2:]}>=1", 1, MOCK + [flag, "0"], [f"{flag} must be >= 1 (got 0)"])
      for flag in ["--pipeline-model-parallel-size", "--num-layers", "--hidden-size", "--num-attention-heads",
                   "--seq-length", "--train-iters", "--log-interval", "--eval-interval", "--lr-wsd-decay-iters",
                   "--max-position-embeddings", "--make-vocab-size-divisible-by"]],
    ("weight-decay>=0", 1, MOCK + ["--weight-decay", "-1"], ["--weight-decay must be >= 0 (got -1.0)"]),
    ("lr-warmup-iters-vs-train-samples", 1, MOCK + ["--train-samples", "10", "--lr-warmup-iters", "2"],
     ["--lr-warmup-iters counts iterations: with --train-samples use its -samples twin"]),
    ("lr-wsd-decay-iters-vs-train-samples", 1, MOCK + ["--train-samples", "10", "--lr-decay-style", "wsd",
                                                       "--lr-wsd-decay-iters", "2"],
     ["--lr-wsd-decay-iters counts iterations: with --train-samples use its -samples twin"]),
    *[(f"{flag[2:]}-needs-train-samples", 1, MOCK + [flag, "5"],
       [f"{flag} counts samples: it needs --train-samples (or use its -iters twin)"])
      for flag in ["--lr-decay-samples", "--lr-wsd-decay-samples"]],
    *[(f"{flag[2:]}>=0", 1, MOCK + ["--train-samples", "10", flag, "-1"], [f"{flag} must be >= 0 (got -1)"])
      for flag in ["--lr-warmup-samples", "--lr-wsd-decay-samples"]],
    ("rampup-integers", 1, MOCK + ["--rampup-batch-size", "a", "4", "10"],
     ["--rampup-batch-size takes three integers START INCR SAMPLES, got a 4 10"]),
    ("exit-on-drains", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--async-drain-interval", "4",
                                       "--exit-interval", "6"],
     ["--exit-interval (6) must be a multiple of --async-drain-interval (4)"]),
    *[(f"{flag[2:]}-needs-pipeoptim", 2, PP2_ASYNC + ["--pipeline-method", "pipedream", flag, value],
       [f"{flag} applies to --pipeline-method pipeoptim, not pipedream"])
      for flag, value in [("--prediction-horizon", "sqrt"), ("--rollout-gradient", "zero-mean")]],
    *[(f"{argv[0][2:]}-needs-async", 1, MOCK + argv,
       [f"{argv[0]} applies to asynchronous pipeline methods, not --pipeline-method 1f1b"])
      for argv in [["--weight-predictor", "rollout"], ["--prediction-horizon", "sqrt"],
                   ["--rollout-gradient", "zero-mean"], ["--delay-compensation-lambda", "0.1"],
                   ["--delay-compensation-adaptive"], ["--async-error-feedback"]]],
    ("no-save-rng-needs-save", 1, MOCK + ["--no-save-rng"], ["--no-save-rng needs --save"]),
    ("add-qkv-bias-needs-local", 1, MOCK + TE + ["--add-qkv-bias", "--disable-bias-linear"],
     ["--add-qkv-bias needs --transformer-impl local"]),
    ("reset-position-ids-needs-local", 1, MOCK + TE + ["--reset-position-ids"],
     ["--reset-position-ids needs --transformer-impl local"]),
    ("log-num-zeros-in-grad-sync-only", 2, PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--log-num-zeros-in-grad"],
     ["--log-num-zeros-in-grad is logged by the synchronous methods"]),
    # Mixture of Experts (models/moe/rules.py)
    *[(f"{flag[2:]}>=1", 1, MOCK + [flag, "0"], [f"{flag} must be >= 1 (got 0)"])
      for flag in ["--num-experts", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
                   "--expert-tensor-parallel-size", "--moe-router-num-groups", "--moe-router-group-topk",
                   "--expert-model-parallel-size"]],
    *[(f"{argv[0][2:]}-needs-experts", 2, MOCK + argv, [f"{argv[0]} applies to a mixture of experts: add --num-experts"])
      for argv in [["--expert-model-parallel-size", "2"], ["--expert-tensor-parallel-size", "1"],
                   ["--moe-ffn-hidden-size", "8"], ["--moe-shared-expert-intermediate-size", "8"],
                   ["--moe-aux-loss-coeff", "0.1"], ["--moe-z-loss-coeff", "0.1"], ["--moe-router-enable-expert-bias"],
                   ["--moe-expert-capacity-factor", "1"], ["--moe-pad-expert-input-to-capacity"], ["--moe-grouped-gemm"],
                   ["--moe-layer-freq", "2"], ["--moe-router-num-groups", "2"], ["--moe-router-group-topk", "1"],
                   ["--moe-router-dtype", "fp64"], ["--moe-layer-recompute"], ["--moe-router-force-load-balancing"],
                   ["--moe-enable-deepep"]]],
    *[(f"{argv[0][2:]}-refused", 1, MOCK + ["--num-experts", "8"] + argv, [f"{argv[0]} is Megatron's, not implemented"])
      for argv in [["--moe-input-jitter-eps", "0.01"]]],
    ("moe-group-topk-needs-groups", 1, MOCK + ["--num-experts", "8", "--moe-router-group-topk", "2"],
     ["--moe-router-group-topk needs --moe-router-num-groups"]),
    ("moe-experts-vs-groups", 1, MOCK + ["--num-experts", "8", "--moe-router-num-groups", "3",
                                         "--moe-router-group-topk", "2"],
     ["--num-experts (8) is not divisible by --moe-router-num-groups (3)"]),
    ("moe-group-topk-vs-groups", 1, MOCK + ["--num-experts", "8", "--moe-router-num-groups", "2",
                                            "--moe-router-group-topk", "4"],
     ["--moe-router-group-topk (4) must be at most --moe-router-num-groups (2)"]),
    ("moe-group-topk-vs-topk", 1, MOCK + ["--num-experts", "8", "--moe-router-num-groups", "4",
                                          "--moe-router-group-topk", "1", "--moe-router-topk", "4"],
     ["--moe-router-group-topk 1 of --moe-router-num-groups 4 (2 experts each) with --moe-router-topk 4",
      "group-topk <= topk <= group-topk x experts per group"]),
    ("moe-group-topk-vs-topk/below", 1, MOCK + ["--num-experts", "8", "--moe-router-num-groups", "4",
                                                "--moe-router-group-topk", "3", "--moe-router-topk", "2"],
     ["--moe-router-group-topk 3 of --moe-router-num-groups 4", "with --moe-router-topk 2"]),
    ("moe-sinkhorn-refused", 1, MOCK + ["--num-experts", "8", "--moe-router-load-balancing-type", "sinkhorn"],
     ["--moe-router-load-balancing-type sinkhorn is Megatron's, not implemented here"]),
    ("moe-deepep-needs-flex", 1, MOCK + ["--num-experts", "8", "--moe-enable-deepep"],
     ["--moe-enable-deepep needs --moe-token-dispatcher-type flex (got allgather"]),
    ("moe-flex-no-padding", 1, MOCK + ["--num-experts", "8", "--moe-token-dispatcher-type", "flex",
                                       "--moe-expert-capacity-factor", "1", "--moe-pad-expert-input-to-capacity"],
     ["--moe-token-dispatcher-type flex with --moe-pad-expert-input-to-capacity"]),
    ("moe-topk-range", 1, MOCK + ["--num-experts", "8", "--moe-router-topk", "9"],
     ["--moe-router-topk (9) must be in [1, --num-experts (8)]"]),
    ("moe-layer-freq", 1, MOCK + ["--num-experts", "8", "--moe-layer-freq", "[0]*3"],
     ["--moe-layer-freq '[0]*3' must list one 0 or 1 per layer: 3 entries for --num-layers 2"]),
    ("moe-layer-freq/not-a-list", 1, MOCK + ["--num-experts", "8", "--moe-layer-freq", "open('x')"],
     ["--moe-layer-freq \"open('x')\" is not an integer N"]),
    ("experts-vs-ep", 3, MOCK + ["--num-experts", "8", "--expert-model-parallel-size", "3"],
     ["--num-experts (8) is not divisible by --expert-model-parallel-size (3)"]),
    ("ep-x-etp-vs-stage", 2, MOCK + ["--num-experts", "8", "--expert-model-parallel-size", "4"],
     ["--expert-model-parallel-size (4) x --expert-tensor-parallel-size (1) = 4 does not divide the ranks of a "
      "pipeline stage (tensor x context x data parallel = 1 x 1 x 2)"]),
    ("moe-tp-needs-sequence-parallel", 2, MOCK + ["--num-experts", "8", "--tensor-model-parallel-size", "2"],
     ["MoE with --tensor-model-parallel-size 2 needs --sequence-parallel"]),
    ("moe-ffn-vs-etp", 2, MOCK + ["--num-experts", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--moe-ffn-hidden-size", "33"],
     ["the expert MLP size (33) is not divisible by --expert-tensor-parallel-size (2)"]),
    ("moe-shared-expert-gate-needs-shared", 1, MOCK + ["--num-experts", "8", "--moe-shared-expert-gate"],
     ["--moe-shared-expert-gate gates the shared experts: add --moe-shared-expert-intermediate-size"]),
    ("moe-shared-vs-tp", 2, MOCK + ["--num-experts", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--moe-shared-expert-intermediate-size", "33"],
     ["--moe-shared-expert-intermediate-size (33) is not divisible by --tensor-model-parallel-size (2)"]),
    ("moe-bias-vs-etp", 2, MOCK + ["--num-experts", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     ["expert biases with --expert-tensor-parallel-size 2", "--disable-bias-linear"]),
    ("moe-expert-bias-needs-sigmoid", 1, MOCK + ["--num-experts", "8", "--moe-router-enable-expert-bias"],
     ["--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"]),
    ("moe-coefficients>=0", 1, MOCK + ["--num-experts", "8", "--moe-aux-loss-coeff", "-1"],
     ["--moe-aux-loss-coeff (-1.0)", "must be >= 0"]),
    ("moe-capacity>0", 1, MOCK + ["--num-experts", "8", "--moe-expert-capacity-factor", "0"],
     ["--moe-expert-capacity-factor must be > 0 (got 0.0)"]),
    ("moe-pad-needs-capacity", 1, MOCK + ["--num-experts", "8", "--moe-pad-expert-input-to-capacity"],
     ["--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"]),
    ("moe-drop-policy-needs-capacity", 1, MOCK + ["--num-experts", "8", "--moe-token-drop-policy", "position"],
     ["--moe-token-drop-policy position", "add --moe-expert-capacity-factor"]),
    ("moe-grouped-gemm-dtype", 1, MOCK + ["--num-experts", "8", "--moe-grouped-gemm", "--moe-ffn-hidden-size", "30"],
     ["--moe-grouped-gemm cannot run the float32 expert GEMMs here: dimensions [30] x 4 bytes"]),
    ("moe-local-layers", 1, MOCK + TE + ["--num-experts", "8"], ["--num-experts needs --transformer-impl local"]),
    ("moe-per-token-loss", 1, MOCK + ["--num-experts", "8", "--calculate-per-token-loss"],
     ["--calculate-per-token-loss with --num-experts"]),
    ("moe-muon-expert-tp", 8, MOCK + ["--num-experts", "8", "--optimizer", "muon", "--tensor-model-parallel-size", "2",
                                      "--sequence-parallel", "--expert-tensor-parallel-size", "4", "--disable-bias-linear"],
     ["--optimizer muon with --expert-tensor-parallel-size 4 != --tensor-model-parallel-size 2"]),
    ("moe-fp8-shared-dims", 1, MOCK + ["--num-experts", "8", "--fp8-format", "hybrid",
                                       "--moe-shared-expert-intermediate-size", "40"],
     ["--fp8-format needs the shared experts' size per TP rank (40) divisible by 16"]),
    # Multi-latent attention (models/mla_rules.py)
    *[(f"{flag[2:]}>=1", 1, MLA + [flag, "0"], [f"{flag} must be >= 1 (got 0)"])
      for flag in ["--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",
                   "--yarn-original-max-position-embeddings"]],
    *[(f"{argv[0][2:]}-needs-mla", 1, MOCK + argv,
       [f"{argv[0]} applies to multi-latent attention: add --multi-latent-attention"])
      for argv in [["--q-lora-rank", "8"], ["--kv-lora-rank", "8"], ["--qk-head-dim", "8"],
                   ["--qk-pos-emb-head-dim", "8"], ["--v-head-dim", "8"], ["--rotary-scaling-factor", "40"],
                   ["--mscale", "0.707"], ["--mscale-all-dim", "1.0"], ["--yarn-original-max-position-embeddings", "8"],
                   ["--yarn-beta-fast", "16"], ["--yarn-beta-slow", "2"], ["--no-yarn-correction-range-round-to-int"],
                   ["--mla-down-proj-fusion"], ["--mla-latent-norm-epsilon", "1e-6"]]],
    ("cache-mla-latents-refused", 1, MLA + ["--cache-mla-latents"],
     ["--cache-mla-latents is the latent KV cache of Megatron's inference engine", "drop it"]),
    ("rope-type-yarn-needs-mla", 1, MOCK + ["--rope-type", "yarn"],
     ["--rope-type yarn is multi-latent attention's RoPE", "add --multi-latent-attention"]),
    ("mla-vs-group-query-attention", 1, MLA + ["--group-query-attention", "--num-query-groups", "2"],
     ["--group-query-attention with --multi-latent-attention"]),
    ("mla-rope-even", 1, MLA + ["--qk-pos-emb-head-dim", "7"], ["--qk-pos-emb-head-dim (7) must be even"]),
    *[(f"{argv[-1 if len(argv) == 3 else 0][2:]}-vs-mla", 1, MLA + argv,
       [f"{argv[-1 if len(argv) == 3 else 0]} configures the plain attention's RoPE", "--rope-type"])
      for argv in [["--position-embedding-type", "rope", "--use-rope-scaling"],
                   ["--rotary-seq-len-interpolation-factor", "2"], ["--rotary-percent", "0.5"]]],
    ("mla-yarn-settings", 1, MLA + ["--yarn-beta-fast", "1", "--yarn-beta-slow", "2"],
     ["0 < --yarn-beta-slow < --yarn-beta-fast (got 2.0, 1.0)"]),
    ("mla-yarn-settings/factor", 1, MLA + ["--rotary-scaling-factor", "0"], ["--rotary-scaling-factor > 0 (got 0.0)"]),
    ("mla-local-layers", 1, MLA + TE, ["--multi-latent-attention runs in the local layers here"]),
    ("heads-vs-tp/mla", 2, MLA + ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3"],
     ["--num-attention-heads (3) is not divisible by --tensor-model-parallel-size (2)"]),
    ("fp8-dims-by-16/mla", 1, MLA + ["--fp8-format", "hybrid", "--kv-lora-rank", "24"],
     ["--fp8-format needs every FP8 GEMM dimension divisible by 16", "--kv-lora-rank 24"]),
    # Multi-token prediction (models/mtp.py)
    ("mtp-num-layers>=1", 1, MOCK + ["--mtp-num-layers", "0"], ["--mtp-num-layers must be >= 1 (got 0)"]),
    ("mtp-loss-scaling-factor-needs-mtp", 1, MOCK + ["--mtp-loss-scaling-factor", "0.3"],
     ["--mtp-loss-scaling-factor weights the multi-token prediction loss: it needs --mtp-num-layers"]),
    ("mtp-loss-scaling-factor>=0", 1, MOCK + MTP + ["--mtp-loss-scaling-factor", "-0.5"],
     ["--mtp-loss-scaling-factor must be >= 0 (got -0.5)"]),
    ("mtp-position-embedding", 1, MOCK + ["--mtp-num-layers", "1"],
     ["--mtp-num-layers needs --position-embedding-type rope or none (got learned_absolute)"]),
]

# (id, world size, pretrain_nmt.py argv, words the error line must contain)
NMT_RULES = [
    ("uneven-split-gpt-only", 2, NMT + ["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers",
                                        "1"], ["--decoder-last-pipeline-num-layers is pretrain_gpt.py's"]),
    ("fsdp-gpt-only", 2, NMT + ["--use-torch-fsdp2"], ["--use-torch-fsdp2", "wired for GPT (pretrain_gpt.py) only"]),
    ("eod-mask-loss-gpt-only", 1, NMT + ["--eod-mask-loss"], ["--eod-mask-loss applies to pretrain_gpt.py"]),
    ("recompute-full-gpt-only", 1, NMT + ["--recompute-granularity", "full", "--recompute-method", "block",
                                          "--recompute-num-layers", "1"],
     ["--recompute-granularity full is wired for GPT (pretrain_gpt.py) only", "--recompute-granularity selective"]),
    ("fp8-torchao-gpt-only", 1, NMT + ["--fp8-format", "hybrid"], ["--fp8-backend torchao is wired for GPT"]),
    ("te-gpt-only", 1, NMT + TE, ["--transformer-impl transformer_engine is wired for GPT (pretrain_gpt.py) only"]),
    ("group-query-attention-gpt-only", 1, NMT + ["--group-query-attention"],
     ["--group-query-attention applies to pretrain_gpt.py"]),
    ("no-data-loader-workers", 1, NMT + ["--num-workers", "2"],
     ["--num-workers (2) and --dataloader-type (single) apply to pretrain_gpt.py"]),
    ("layers>=1", 1, NMT + ["--encoder-num-layers", "0", "--decoder-num-layers", "2"],
     ["--encoder-num-layers (0) and --decoder-num-layers (2) must be >= 1"]),
    ("num-layers>=1", 1, NMT + ["--encoder-num-layers", "0", "--decoder-num-layers", "0"],
     ["--encoder-num-layers + --decoder-num-layers must be >= 1 (got 0)"]),
    ("decoder-seq>=2", 1, NMT + ["--decoder-seq-length", "1"], ["--decoder-seq-length must be >= 2 (got 1)"]),
    ("decoder-seq-vs-positions", 1, NMT + ["--max-position-embeddings", "128", "--decoder-seq-length", "200"],
     ["--decoder-seq-length (200) exceeds --max-position-embeddings (128)"]),
    ("no-sequence-parallel", 1, NMT + ["--sequence-parallel"],
     ["--sequence-parallel is not supported by pretrain_nmt.py"]),
    ("no-mock-data", 1, ["--mock-data", "--tokenizer-model", "t.model"],
     ["pretrain_nmt.py needs a parallel corpus", "(--mock-data is GPT only)"]),
    ("one-data-path", 1, ["--data-path", "0.5", "A", "0.5", "B", "--tokenizer-model", "t.model"],
     ["pretrain_nmt.py takes one --data-path PREFIX", "got 4 values"]),
    ("no-split", 1, NMT + ["--split", "90,5,5"], ["--split (90,5,5) does not apply to pretrain_nmt.py"]),
    ("sentencepiece", 1, ["--data-path", "corpus", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
     ["pretrain_nmt.py needs --tokenizer-type SentencePieceTokenizer"]),
    ("languages-differ", 1, NMT + ["--tgt-lang", "en"], ["--src-lang and --tgt-lang are both 'en'"]),
    ("tgt-tokenizer-needs-untied", 1, NMT + ["--tgt-tokenizer-model", "fr.model"],
     ["--tgt-tokenizer-model", "add --untie-encoder-decoder-embeddings"]),
    ("label-smoothing", 1, NMT + ["--label-smoothing", "1.0"], ["--label-smoothing must be in [0, 1) (got 1.0)"]),
    ("max-tokens-holds-a-sentence", 1, NMT + ["--max-tokens", "100", "--decoder-seq-length", "130"],
     ["--max-tokens (100) must hold one sentence", "max(--seq-length, --decoder-seq-length) = 130"]),
    ("eval-bleu-sentences>=0", 1, NMT + ["--eval-bleu-sentences", "-1"],
     ["--eval-bleu-sentences must be >= 0 (got -1)"]),
    ("context-parallel-gpt-only", 2, NMT + ["--context-parallel-size", "2", "--attention-dropout", "0"],
     ["--context-parallel-size 2 splits the causal self-attention of pretrain_gpt.py", "use 1"]),
    *[(f"{argv[0][2:]}-gpt-only", 1, NMT + argv,
       [f"{argv[0]} applies to pretrain_gpt.py (documents in one token stream), not pretrain_nmt.py"])
      for argv in [["--reset-position-ids"], ["--reset-attention-mask"], ["--calculate-per-token-loss"],
                   ["--decoupled-lr", "1e-3"]]],
    *[(f"{argv[0][2:]}-gpt-only", 1, NMT + argv, [f"{argv[0]} applies to pretrain_gpt.py: the NMT model's"])
      for argv in [["--kv-channels", "32"], ["--qk-layernorm"]]],
    ("moe-gpt-only", 1, NMT + ["--num-experts", "8"], ["--num-experts is wired for pretrain_gpt.py only"]),
    ("mla-gpt-only", 1, NMT + ["--multi-latent-attention"], ["--multi-latent-attention applies to pretrain_gpt.py"]),
    ("add-qkv-bias-gpt-only", 1, NMT + ["--add-qkv-bias"], ["--add-qkv-bias applies to pretrain_gpt.py"]),
    ("mtp-gpt-only", 1, NMT + ["--mtp-num-layers", "1"], ["--mtp-num-layers predicts further tokens of pretrain_gpt.py"]),
    ("padded-vocab-size-gpt-only", 1, NMT + ["--padded-vocab-size", "1024"],
     ["--padded-vocab-size sets pretrain_gpt.py's one vocabulary"]),
]
CASES = [(case, world, argv, words, "gpt") for case, world, argv, words in RULES] + \
        [(case, world, argv, words, "nmt") for case, world, argv, words in NMT_RULES]
CASE_IDS = [r[0] for r in RULES] + ["nmt:" + r[0] for r in NMT_RULES]


@pytest.fixture(autouse=True)
def no_visible_gpu(monkeypatch, request):
    """`te-importable` fails on every machine: TE's import fails without TE, and with it no GPU is visible."""
    monkeypatch.setattr(te_transformer, "_gpu_visible", lambda: False)
    # --attention-backend flash/fused need a GPU; --optimizer-cpu-offload's row runs on a faked one
    on_gpu = "optimizer-cpu-offload-gpu" in request.node.name
    monkeypatch.setattr(config_check, "cuda_device", lambda: on_gpu)
    # `fp8-gpu-capability`'s row runs on a faked A100 (compute capability 8.0); the other rows fail before it.
    monkeypatch.setattr(fp8, "_cuda_capability", lambda: ("NVIDIA A100", (8, 0)))


def _validate(argv, world, workload="gpt"):
    """What pretrain_gpt.py / pretrain_nmt.py do with a command line before any process group exists."""
    cfg = parse_args(argv)
    validate(normalize_nmt(cfg) if workload == "nmt" else cfg, world, workload)


def _rule(case: str) -> str:
    """The rule a row breaks: its id up to a "/" (the rest names another case of the same rule)."""
    return case.split("/")[0]


@pytest.mark.parametrize("case, world, argv, words, workload", CASES, ids=CASE_IDS)
def test_rule_gives_one_line_naming_flags(case, world, argv, words, workload):
    with pytest.raises(ConfigError) as info:
        _validate(argv, world, workload)
    message = str(info.value)
    assert "\n" not in message
    for w in words:
        assert w in message, (w, message)
    assert info.value.rule == _rule(case), "the row's command line broke another rule first"


def test_every_rule_has_a_row():
    names = [rule.name for rule in config_rules.RULES]
    assert len(names) == len(set(names)), f"rules sharing a name: {sorted({n for n in names if names.count(n) > 1})}"
    rows = {_rule(case) for case, *_ in CASES}
    missing = [n for n in names if n not in rows]
    assert not missing, f"rules without a row in RULES / NMT_RULES: {missing}"
    assert not rows - set(names), f"rows naming no rule of config_rules.RULES: {sorted(rows - set(names))}"


def test_the_base_command_lines_are_valid(monkeypatch):
    """Each row breaks one rule: its base (mock data; PP=2 async with untied embeddings; FP8 on a usable
    Transformer Engine, here the fake one; an NMT corpus) passes."""
    validate(parse_args(MOCK), 1)
    validate(parse_args(MOCK + MTP + ["--mtp-loss-scaling-factor", "0.3"]), 1)
    validate(parse_args(CP2), 2)
    validate(parse_args(CP2 + MTP), 2)
    validate(parse_args(CP2 + ["--context-parallel-size", "4", "--tensor-model-parallel-size", "2",
                               "--sequence-parallel", "--cp-comm-type", "all_gather"]), 8)
    validate(parse_args(PP2_ASYNC + ["--pipeline-method", "pipeoptim"]), 2)
    # PipeOptim predicts from the stored bf16 moments (tests/test_precision_aware_optimizer.py)
    low_moments = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    validate(parse_args(PP2_ASYNC + ["--pipeline-method", "pipeoptim"] + low_moments), 2)
    validate(parse_args(PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--bf16", "--use-distributed-optimizer",
                                     "--main-grads-dtype", "bf16"] + low_moments), 4)
    validate(parse_args(PP2_ASYNC + ["--pipeline-method", "pipeoptim", "--bf16", "--use-torch-fsdp2",
                                     "--grad-reduce-in-bf16"] + low_moments), 4)
    validate(parse_args(MOCK + ["--fp16", "--loss-scale", "8"]), 1)
    validate(parse_args(["--data-path", "0.3", "A", "0.7", "B", "--tokenizer-model", "t.model", "--split", "9,1"]), 1)
    validate(parse_args(["--data-path", "A", "B", "--tokenizer-model", "t.model"]), 1)  # unweighted, as Megatron
    _validate(NMT, 1, "nmt")
    _validate(NMT + ["--max-position-embeddings", "128", "--max-tokens", "128", "--tgt-tokenizer-model", "fr.model",
                     "--untie-encoder-decoder-embeddings"], 1, "nmt")
    monkeypatch.setattr(fp8, "_cuda_capability", lambda: None)  # FP8 on a CPU: torchao's emulation
    validate(parse_args(MOCK + ["--fp8-format", "hybrid", "--bf16"]), 1)
    validate(parse_args(MOCK + ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]), 1)
    validate(parse_args(MOCK + ["--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-grouped-gemm",
                                "--moe-layer-freq", "([0]*1+[1]*1)", "--moe-expert-capacity-factor", "1.5"]), 2)
    validate(parse_args(MOCK + ["--num-experts", "8", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size",
                                "2", "--sequence-parallel", "--disable-bias-linear"]), 4)
    # DeepSeek-V3's MLA flags (sizes shrunk), the query compressed or not, under TP with sequence parallelism, FP8
    deepseek = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
                "--qk-pos-emb-head-dim", "16", "--v-head-dim", "16", "--qk-layernorm", "--rotary-scaling-factor", "40",
                "--mscale", "1.0", "--mscale-all-dim", "1.0", "--rope-type", "yarn", "--position-embedding-type", "rope",
                "--no-rope-fusion", "--kv-channels", "16", "--normalization", "RMSNorm", "--disable-bias-linear",
                "--mla-down-proj-fusion"]
    validate(parse_args(MOCK + deepseek + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]), 2)
    validate(parse_args(MOCK + deepseek[:1] + deepseek[3:] + ["--hidden-size", "112", "--num-attention-heads", "3",
                                                                 "--fp8-format", "hybrid"]), 1)
    fake_transformer_engine.install()
    monkeypatch.setattr(te_transformer, "_gpu_visible", lambda: True)
    try:
        validate(parse_args(TE_FP8), 1)
        validate(parse_args(TE_FP8 + ["--tensor-model-parallel-size", "2", "--hidden-size", "64"]), 2)
    finally:
        fake_transformer_engine.uninstall()
