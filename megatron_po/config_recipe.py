"""The launcher, logging and checkpoint-loading flags that public Megatron recipes pass (NVIDIA's
Megatron-MoE-ModelZoo configs, Megatron-LM's post-training confs), as fields mixed into config.py's sections:
`ModelConfig(ModelRecipeFlags)` and so on, so each lands in its section (`cfg.training.lr_warmup_init`) and
config.py stays one tree. Megatron-LM's names, defaults and meanings; where this code differs the help says so.

What each does here:
- implemented: --lr-warmup-init (optim/sample_schedule.py), --logging-level (training_setup.py),
  --log-timers-to-tensorboard, --log-memory-to-tensorboard, --log-validation-ppl-to-tensorboard and
  --tensorboard-queue-size (training_log.py), --padded-vocab-size (gpt_workload.py), --dist-ckpt-strictness
  (distributed/checkpoint_load.py), --trust-remote-code (data/tokenizer.py);
- implemented, model and optimizer: --use-precision-aware-optimizer with --exp-avg-dtype / --exp-avg-sq-dtype
  bf16|fp16 (optim/optimizers.py Adam) and --main-grads-dtype bf16 (the bf16 gradient buffer); --recompute-modules
  core_attn, mlp, moe, shared_experts (config.py recompute_modules); --moe-router-force-load-balancing (models/moe/router.py
  RandomLogits); --use-rotary-position-embeddings (= --position-embedding-type rope, config_from_namespace);
- accepted, no effect (a GPU kernel or a Megatron code path that has no counterpart here, said in the help):
  --use-flash-attn, --cross-entropy-fusion-impl, --enable-experimental, --moe-per-layer-logging,
  --auto-detect-ckpt-format, --no-ckpt-fully-parallel-save, --ckpt-fully-parallel-load, --moe-enable-deepep (the
  flex dispatcher runs the alltoall one), --cuda-graph-impl, --cuda-graph-scope, --te-rng-tracker,
  --optimizer-cpu-offload (CPU runs; refused on a GPU), --overlap-cpu-optimizer-d2h-h2d, --optimizer-offload-fraction;
- refused with one line: --exp-avg-dtype / --exp-avg-sq-dtype fp8, --main-params-dtype fp16, the --recompute-modules
  moe_act, layernorm, mla_up_proj (and Megatron's others).
- the pipeline split: --decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-split,
  --pipeline-model-parallel-layout, --num-virtual-stages-per-pipeline-rank (layer_split.py; rules in
  layer_split_rules.py).
Their start-up rules and lines: config_recipe_rules.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_po.config_field import flag

# Megatron's StrictHandling values (megatron/core/dist_checkpointing/validation.py).
DIST_CKPT_STRICTNESS = ["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                        "return_unexpected", "return_all", "ignore_all"]


@dataclass
class ModelRecipeFlags:
    padded_vocab_size: int | None = flag(None, "the model's vocabulary (embedding and output layer rows) instead of "
                                               "the tokenizer's padded to --make-vocab-size-divisible-by x TP "
                                               "(Megatron's); must hold the tokenizer's vocabulary and divide by "
                                               "--tensor-model-parallel-size (pretrain_gpt.py)")
    use_flash_attn: bool = flag(False, "Megatron's legacy FlashAttention switch: accepted, no effect, as in Megatron "
                                       "Core (--attention-backend chooses the kernel; its default auto lets PyTorch "
                                       "pick its flash kernel where the device has one)")
    cross_entropy_fusion_impl: str = flag("native", "which fused cross entropy Megatron's "
                                                    "--cross-entropy-loss-fusion runs (native or Transformer "
                                                    "Engine's): accepted, no effect: the vocab-parallel cross "
                                                    "entropy here has one implementation",
                                          choices=["native", "te"])
    use_rotary_position_embeddings: bool = flag(False, "Megatron's older spelling of --position-embedding-type "
                                                       "rope (it sets it, whatever that flag says, as Megatron's)")
    # Megatron-core's selective recomputation by module (transformer_config.py, Megatron-LM d98e8a6)
    recompute_modules: list | None = flag(None, "--recompute-granularity selective: the modules recomputed "
                                                "(Megatron's, default core_attn): core_attn (the attention core, "
                                                "softmax(QKᵀ)V), mlp (the dense MLP), moe (each MoE layer, as "
                                                "--moe-layer-recompute), shared_experts (the MoE layers' shared "
                                                "experts); Megatron's moe_act, layernorm, mla_up_proj are refused "
                                                "here; no effect without selective, as in Megatron",
                                          nargs="+")
    moe_router_force_load_balancing: bool = flag(False, "MoE, for benchmarking (Megatron's): the router's logits "
                                                        "replaced by standard normal noise in the forward (the "
                                                        "default generator's, alike on the TP and CP ranks that "
                                                        "route the same tokens; Megatron's differs per rank), the "
                                                        "gradient passed to the real logits unchanged (a "
                                                        "straight-through estimator): every expert gets about the "
                                                        "same number of tokens")
    moe_enable_deepep: bool = flag(False, "MoE: Megatron's DeepEP kernels of the flex dispatcher (needs "
                                          "--moe-token-dispatcher-type flex, as there): accepted, no effect here: "
                                          "flex runs the alltoall dispatcher (the same numbers; a start-up line "
                                          "says so)")
    cuda_graph_impl: str = flag("none", "Megatron's CUDA graph capture (local or transformer_engine per layer, "
                                        "full_iteration): accepted, no effect here: nothing is captured, the layers "
                                        "run eagerly (or compiled with --torch-compile), the same numbers (a "
                                        "start-up line says so)",
                                choices=["none", "local", "transformer_engine", "full_iteration"])
    cuda_graph_scope: list | None = flag(None, "Megatron's parts of a layer --cuda-graph-impl captures (attn, mlp, "
                                               "moe, moe_router, moe_preprocess, mamba, full_iteration): accepted, "
                                               "no effect here (see --cuda-graph-impl)", nargs="+")
    te_rng_tracker: bool = flag(False, "Megatron's choice of Transformer Engine's RNG tracker over Megatron-core's "
                                       "(for CUDA graphs): accepted, no effect here: the model-parallel random "
                                       "streams are tensor_parallel/random.py's")


@dataclass
class ParallelRecipeFlags:
    """How the layers split over pipeline stages (Megatron-core's flags: DeepSeek-V3's and Kimi K2's recipes split
    unevenly), read by layer_split.py."""
    num_virtual_stages_per_pipeline_rank: int | None = flag(
        None, "model chunks per pipeline rank (interleaved pipeline): each rank's layers split evenly over its "
              "chunks; the form Megatron takes with --decoder-first/last-pipeline-num-layers")
    # Uneven pipeline splits (Megatron-core's flags and rules: megatron_po/layer_split.py, docs/pipelines.md)
    decoder_first_pipeline_num_layers: int | None = flag(
        None, "transformer layers on the first pipeline stage; the rest split evenly over the other stages "
              "(default: an even split)")
    decoder_last_pipeline_num_layers: int | None = flag(
        None, "transformer layers on the last pipeline stage; the rest split evenly over the other stages "
              "(default: an even split)")
    account_for_embedding_in_pipeline_split: bool = flag(
        False, "count the embedding as one layer in the even pipeline split: the first virtual stage builds one "
               "layer fewer")
    account_for_loss_in_pipeline_split: bool = flag(
        False, "count the loss (final norm, output layer) as one layer in the even pipeline split: the last virtual "
               "stage builds one layer fewer")
    pipeline_model_parallel_layout: str | None = flag(
        None, "every virtual stage's layers, e.g. \"Et|(tt|)*30mL\": E embedding, t transformer layer, m MTP depth, "
              "L loss, '|' between virtual stages (their count / --pipeline-model-parallel-size = model chunks per "
              "rank), (...)*n and x*n repeat. Here E goes first on virtual stage 0 and m, L on the last one (Megatron "
              "can also put m on a stage of its own); a stage holding nothing is refused")


@dataclass
class DataRecipeFlags:
    trust_remote_code: bool = flag(False, "HuggingFaceTokenizer: let transformers run the Python code a local "
                                          "tokenizer directory ships (auto_map in its tokenizer_config.json, e.g. "
                                          "Kimi K2's); without it such a tokenizer is refused")


@dataclass
class TrainingRecipeFlags:
    lr_warmup_init: float = flag(0.0, "the lr the linear warm-up starts from (Megatron's): init + (--lr - init) x "
                                      "the warm-up's progress (--decoupled-lr's warm-up starts there too); "
                                      "0 <= init <= --lr")
    enable_experimental: bool = flag(False, "Megatron's switch of its experimental code paths: accepted, no effect "
                                            "(nothing here is gated behind it)")
    # Megatron's precision-aware optimizer (megatron/core/optimizer/optimizer_config.py, Megatron-LM d98e8a6):
    # Transformer Engine's FusedAdam storing its tensors in lower precision; here the Adam state dtypes
    # (optim/optimizers.py Adam), the other two as said.
    use_precision_aware_optimizer: bool = flag(False, "Megatron's precision-aware optimizer: lets --exp-avg-dtype, "
                                                      "--exp-avg-sq-dtype, --main-grads-dtype, --main-params-dtype "
                                                      "differ from fp32 (--optimizer adam or adamw; any of the "
                                                      "distributed, mixed-precision or FSDP2 optimizers, where "
                                                      "Megatron needs --use-distributed-optimizer)")
    exp_avg_dtype: str = flag("fp32", "--use-precision-aware-optimizer: Adam's first moment stored in this dtype and "
                                      "computed in fp32 (each step upcasts it, steps with the unrounded value, stores "
                                      "it rounded, as Transformer Engine's FusedAdam; PipeOptim's weight prediction "
                                      "reads the stored moments upcast to fp32); fp8 (scaled) is refused",
                              choices=["fp32", "fp16", "bf16", "fp8"])
    exp_avg_sq_dtype: str = flag("fp32", "--use-precision-aware-optimizer: Adam's second moment stored in this dtype "
                                         "(as --exp-avg-dtype); fp8 is refused",
                                 choices=["fp32", "fp16", "bf16", "fp8"])
    main_grads_dtype: str = flag("fp32", "--use-precision-aware-optimizer: bf16 keeps the gradient buffer in bf16 "
                                         "(needs --bf16; this project's default with --bf16 already, the "
                                         "optimizer upcasts each gradient as FusedAdam does); fp32: the buffer as "
                                         "--accumulate-allreduce-grads-in-fp32 says",
                                 choices=["fp32", "bf16"])
    main_params_dtype: str = flag("fp32", "--use-precision-aware-optimizer: dtype of the main params; fp16 is "
                                          "refused (the main params are fp32 here)", choices=["fp32", "fp16"])
    optimizer_cpu_offload: bool = flag(False, "Megatron's hybrid CPU/GPU optimizer (optimizer states and step on "
                                              "the CPU; needs --use-precision-aware-optimizer as there): on a CPU "
                                              "run accepted, no effect (state and step are on the CPU already); "
                                              "on a GPU refused, not implemented here")
    optimizer_offload_fraction: float = flag(0.0, "--optimizer-cpu-offload: the fraction of the optimizer state "
                                                  "offloaded, in [0, 1]")
    overlap_cpu_optimizer_d2h_h2d: bool = flag(False, "--optimizer-cpu-offload: overlap the CPU step with the "
                                                      "device<->host copies: accepted, no effect (there are no "
                                                      "copies on a CPU run)")


@dataclass
class LoggingRecipeFlags:
    logging_level: int | None = flag(None, "level of Python's root logger (Megatron's: 40 = ERROR, 30 = WARNING, "
                                           "20 = INFO; default the MEGATRON_LOGGING_LEVEL environment variable, "
                                           "else unchanged): the libraries' log records below it are dropped; "
                                           "this code's own lines are printed and stay")
    log_timers_to_tensorboard: bool = flag(False, "TensorBoard also gets the timers (time/*, --timing-log-level) and "
                                                  "the throughput (tokens_per_sec; tflops_per_gpu, mfu with "
                                                  "--log-throughput), as Megatron's; the metrics file and W&B "
                                                  "always get them")
    log_memory_to_tensorboard: bool = flag(False, "TensorBoard also gets the memory (memory_gb, max_memory_gb), as "
                                                  "Megatron's; the metrics file and W&B always get it")
    log_validation_ppl_to_tensorboard: bool = flag(False, "TensorBoard also gets the validation perplexity "
                                                          "(val_ppl; val_loss always), as Megatron's; the metrics "
                                                          "file and W&B always get it")
    tensorboard_queue_size: int = flag(1000, "TensorBoard events held before they are written to disk "
                                             "(SummaryWriter's max_queue, as Megatron's)")
    moe_per_layer_logging: bool = flag(False, "MoE: Megatron's per-layer logging of the routers' losses: accepted, "
                                              "no effect: each MoE layer's numbers are always logged here "
                                              "(moe/<name>/layer<i>) beside their means")


@dataclass
class CheckpointRecipeFlags:
    dist_ckpt_strictness: str | None = flag(None, "--load's handling of a parameter the checkpoint lacks (Megatron's "
                                                  "'unexpected' key) and of a checkpoint tensor the model lacks "
                                                  "('missing'): raise_all (the default here; Megatron's: "
                                                  "assume_ok_unexpected) stops on either with one line; "
                                                  "assume_ok_unexpected, raise_unexpected stop on the first and "
                                                  "skip the second; log_unexpected logs the first, skips the second; "
                                                  "log_all logs both; ignore_all skips both; a skipped parameter "
                                                  "keeps its initial value and gets a fresh optimizer state; "
                                                  "return_unexpected, return_all are refused (they hand the keys "
                                                  "to a Python caller)", choices=DIST_CKPT_STRICTNESS)
    auto_detect_ckpt_format: bool = flag(False, "Megatron's choice between its legacy and distributed checkpoint "
                                                "formats at --load: accepted, no effect: there is one format here "
                                                "(torch_dist, DCP), and --load stops with one line on another")
    ckpt_fully_parallel_save: bool = flag(True, "Megatron's switch-off of spreading the save over the data-parallel "
                                                "ranks: accepted, no effect: DCP's save plan here writes each "
                                                "replicated tensor once, spread over the ranks that hold it")
    ckpt_fully_parallel_load: bool = flag(False, "Megatron's load of each tensor by one data-parallel rank and an "
                                                 "exchange: accepted, no effect: each rank reads its own pieces "
                                                 "through DCP")
