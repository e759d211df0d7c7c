"""One dataclass config tree; the command-line flags are generated from it.

Every leaf field becomes a Megatron-named flag: `hidden_size` -> `--hidden-size`. Booleans that default
to False are `store_true` flags; booleans that default to True get a `--no-...` flag instead. Field
names are unique across the tree so the flag namespace stays flat, as Megatron users expect.

The cross-flag rules live in config_rules.py (a table that `config_rules.validate` walks), above this
module and models/: this module imports nothing from models/.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import get_args, get_origin, get_type_hints

from megatron_po.config_field import flag as _f
from megatron_po.config_recipe import (CheckpointRecipeFlags, DataRecipeFlags, LoggingRecipeFlags,
                                       ModelRecipeFlags, ParallelRecipeFlags, TrainingRecipeFlags)
from megatron_po.data.tokenizer import TOKENIZER_TYPES
from megatron_po.errors import ConfigError
from megatron_po.layer_split import layout_stage_count


@dataclass
class ModelConfig(ModelRecipeFlags):
    num_layers: int = _f(2, "number of transformer layers")
    hidden_size: int = _f(128, "transformer hidden size")
    ffn_hidden_size: int | None = _f(None, "MLP hidden size (default 4 x hidden; 8/3 x hidden rounded for SwiGLU)")
    num_attention_heads: int = _f(4, "number of attention heads")
    group_query_attention: bool = _f(False, "grouped-query attention: --num-query-groups key/value heads shared by "
                                            "the query heads (1 = multi-query attention)")
    num_query_groups: int = _f(1, "key/value heads with --group-query-attention (divides --num-attention-heads and "
                                  "is divisible by --tensor-model-parallel-size)")
    kv_channels: int | None = _f(None, "dimension of one attention head (default hidden / heads)")
    qk_layernorm: bool = _f(False, "normalize each query and key head (--normalization, over the head dimension) "
                                   "before RoPE and the dot product; with --multi-latent-attention: normalize the "
                                   "query and key/value latents instead (DeepSeek's q_a/kv_a norms)")
    seq_length: int = _f(128, "training sequence length")
    max_position_embeddings: int | None = _f(None, "size of the learned position table (default seq_length)")
    position_embedding_type: str = _f("learned_absolute", "position encoding",
                                      choices=["learned_absolute", "rope", "none"])
    add_position_embedding: bool = _f(True, "with --no-position-embedding no learned position table (Megatron's "
                                            "Llama scripts pair it with --position-embedding-type rope)",
                                      alias="--no-position-embedding")
    rotary_base: int = _f(10000, "RoPE base (the theta of the frequencies base^(-2i/d))")
    rotary_percent: float = _f(1.0, "RoPE rotates this fraction of each head's dimensions (the first ones); the "
                                    "rest pass through")
    rotary_seq_len_interpolation_factor: int | None = _f(None, "RoPE position interpolation: positions are divided "
                                                               "by this factor (HF Llama's linear rope scaling)")
    use_rope_scaling: bool = _f(False, "RoPE frequency scaling of Llama 3.1 (HF's llama3 rope type): frequencies whose "
                                       "wavelength exceeds 8192 positions are divided by --rope-scaling-factor, "
                                       "those under 2048 are kept, those between are blended")
    rope_scaling_factor: float = _f(8.0, "--use-rope-scaling: the factor the low frequencies are divided by (Llama "
                                         "3.1: 8, Llama 3.2: 32)")
    normalization: str = _f("LayerNorm", "normalization layer", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = _f(1e-5, "epsilon of the normalization layers")
    apply_layernorm_1p: bool = _f(False, "zero-centered norm weights: the norms multiply by (1 + weight), weight "
                                         "initialized to 0 (LayerNorm and RMSNorm)")
    swiglu: bool = _f(False, "SwiGLU MLP instead of GELU")
    untie_embeddings_and_output_weights: bool = _f(False, "separate output layer weights (required by async pipelines)")
    hidden_dropout: float = _f(0.1, "dropout on hidden states")
    attention_dropout: float = _f(0.1, "dropout on attention probabilities")
    recompute_granularity: str | None = _f(None, "activation recomputation: full (whole layers, see "
                                           "--recompute-method) or selective (the attention core only)",
                                           choices=["full", "selective"])
    recompute_method: str | None = _f(None, "--recompute-granularity full: uniform (every group of "
                                      "--recompute-num-layers layers) or block (the first --recompute-num-layers "
                                      "layers of each model chunk)", choices=["uniform", "block"])
    recompute_num_layers: int | None = _f(None, "--recompute-granularity full: layers per recomputed group "
                                          "(uniform) or recomputed layers per model chunk (block)")
    recompute_activations: bool = _f(False, "recompute the attention core (= --recompute-granularity selective)")
    init_method_std: float = _f(0.02, "std of the normal weight init; output projections get std/sqrt(2*layers)")
    add_bias_linear: bool = _f(True, "no biases in the linear layers (QKV, attention output, MLP)",
                               alias="--disable-bias-linear")
    add_qkv_bias: bool = _f(False, "a bias on the attention's QKV projection even with --disable-bias-linear (Qwen2, "
                                   "GLM-4.5), split over the TP ranks like the projection's rows")
    attention_backend: str = _f("auto", "attention kernel: auto (PyTorch picks), local/unfused (explicit "
                                        "softmax(QK^T)V, any device), flash/fused (flash / cuDNN kernels, CUDA)",
                                choices=["auto", "flash", "fused", "unfused", "local"])
    cp_comm_type: str = _f("p2p", "how context-parallel attention meets the other ranks' keys and values: p2p (ring "
                                  "attention: K/V blocks passed around the CP ring, the next transfer overlapping "
                                  "the current block's attention) or allgather (K/V gathered once per layer; "
                                  "all_gather is the same); Megatron's a2a and a2a+p2p are not available here",
                           choices=["p2p", "allgather", "all_gather"])
    attention_softmax_in_fp32: bool = _f(False, "with --bf16/--fp16 compute attention (softmax included) in fp32")
    use_mcore_models: bool = _f(False, "accepted for Megatron-LM scripts; no effect (one model implementation, "
                                       "Megatron Core's layout)")
    masked_softmax_fusion: bool = _f(True, "no effect: CUDA kernel-fusion switch (attention runs in one "
                                           "scaled_dot_product_attention call)")
    bias_gelu_fusion: bool = _f(True, "no effect: CUDA kernel-fusion switch")
    bias_swiglu_fusion: bool = _f(True, "no effect: CUDA kernel-fusion switch")
    bias_dropout_fusion: bool = _f(True, "no effect: CUDA kernel-fusion switch")
    apply_rope_fusion: bool = _f(True, "no effect: CUDA kernel-fusion switch", alias="--no-rope-fusion")
    persist_layer_norm: bool = _f(True, "no effect: CUDA kernel switch (persistent LayerNorm kernel)")
    gradient_accumulation_fusion: bool = _f(True, "no effect: CUDA kernel-fusion switch (weight gradients are "
                                                  "accumulated by autograd)")
    make_vocab_size_divisible_by: int = _f(128, "pad the vocabulary to a multiple of this x TP size")
    transformer_impl: str = _f("local", "transformer layers: local (PyTorch) or transformer_engine (NVIDIA "
                                        "Transformer Engine, GPUs; requirements-gpu.txt)",
                               choices=["local", "transformer_engine"])
    fp8_format: str | None = _f(None, "FP8 GEMMs in the transformer layers (QKV, attention projection, MLP): hybrid "
                                      "(E4M3 forward, E5M2 gradients) or e4m3; through --fp8-backend (docs/fp8.md)",
                                choices=["hybrid", "e4m3"])
    fp8_recipe: str | None = _f(None, "FP8 scaling recipe: delayed (Transformer Engine, its default), tensorwise "
                                      "(torchao, its default) or rowwise (torchao, with --fp8-format e4m3); mxfp8 and "
                                      "blockwise (Megatron's, Blackwell) are not available here",
                                choices=["delayed", "tensorwise", "rowwise", "mxfp8", "blockwise"])
    fp8_backend: str = _f("auto", "who runs --fp8-format: te (Transformer Engine's layers), torchao (torchao's float8 "
                                  "GEMMs in the local layers; emulated on a CPU) or auto (te with --transformer-impl "
                                  "transformer_engine, else torchao)", choices=["auto", "te", "torchao"])
    fp8_margin: int = _f(0, "FP8 delayed scaling: scaling factor margin (powers of 2)")
    fp8_amax_history_len: int = _f(1, "FP8 delayed scaling: amax history length")
    fp8_amax_compute_algo: str = _f("most_recent", "FP8 delayed scaling: amax taken from the history",
                                    choices=["most_recent", "max"])
    torch_compile: bool = _f(False, "compile every transformer layer with torch.compile (inductor; once per distinct "
                                    "shape, at the first micro-batches): fused norms, activations and residuals; "
                                    "and the optimizer step with PipeOptim's prediction fused into it; "
                                    "docs/compile.md")
    chunked_output_loss: bool = _f(True, "with --no-chunked-output-loss the output layer makes the [tokens x vocab] "
                                         "logits, then the vocab-parallel cross entropy runs on them; by default "
                                         "the two run together over chunks of tokens and never hold those logits "
                                         "(equal within rounding; compiled with --torch-compile; docs/compile.md)")
    # Mixture of Experts (Megatron-core's flags and meanings; megatron_po/models/moe/, docs/moe.md)
    num_experts: int | None = _f(None, "MoE: routed experts per MoE layer (default: none, dense MLPs)")
    moe_ffn_hidden_size: int | None = _f(None, "MoE: hidden size of one expert's MLP (default --ffn-hidden-size)")
    moe_router_topk: int = _f(2, "MoE: experts each token is routed to")
    moe_layer_freq: str = _f("1", "MoE: which layers are MoE: N = every N-th layer from the first, or Megatron's "
                                  "list form with one 0/1 per layer, e.g. '([0]*1+[1]*3)' (1 = MoE)")
    moe_shared_expert_intermediate_size: int | None = _f(None, "MoE: hidden size of the shared experts every token "
                                                               "goes through (default: none)")
    moe_shared_expert_gate: bool = _f(False, "MoE: scale the shared experts' output by sigmoid(x w), w a learned "
                                              "[1, hidden] gate (Megatron's; Qwen2-MoE's shared_expert_gate)")
    moe_router_score_function: str = _f("softmax", "MoE: router scores", choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool = _f(False, "MoE: softmax over all experts before the top-k (default: over the "
                                             "top-k logits)")
    moe_router_topk_scaling_factor: float | None = _f(None, "MoE: multiply the top-k routing weights by this")
    moe_router_load_balancing_type: str = _f("aux_loss", "MoE: load balancing: aux_loss (Switch Transformer's, "
                                                         "per micro-batch), seq_aux_loss (per sequence), "
                                                         "global_aux_loss (the expert loads counted over the "
                                                         "data-parallel ranks and the step's micro-batches so far, "
                                                         "Megatron's), none; sinkhorn is refused here",
                                             choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "none",
                                                      "sinkhorn"])
    moe_aux_loss_coeff: float = _f(0.0, "MoE: coefficient of the load-balancing loss (0: none)")
    moe_z_loss_coeff: float | None = _f(None, "MoE: coefficient of the router z-loss (ST-MoE)")
    moe_router_enable_expert_bias: bool = _f(False, "MoE: DeepSeek-V3's aux-loss-free balancing: a per-expert bias "
                                                    "on the routing scores, moved after every step toward equal loads")
    moe_router_bias_update_rate: float = _f(1e-3, "MoE: step of the expert bias update")
    moe_expert_capacity_factor: float | None = _f(None, "MoE: expert capacity = factor x tokens x top-k / experts per "
                                                        "micro-batch; tokens past it are dropped (default: dropless)")
    moe_token_drop_policy: str = _f("probs", "MoE: which tokens an over-capacity expert keeps: the highest routing "
                                             "weights (probs) or the first (position)", choices=["probs", "position"])
    moe_pad_expert_input_to_capacity: bool = _f(False, "MoE: every expert gets exactly its capacity of tokens "
                                                       "(padded; fixed shapes)")
    moe_token_dispatcher_type: str = _f("allgather", "MoE: how tokens reach their experts over the expert-parallel "
                                                     "ranks: allgather or alltoall (flex is refused here)",
                                        choices=["allgather", "alltoall", "flex"])
    moe_grouped_gemm: bool = _f(False, "MoE: the local experts as one grouped GEMM (torch._grouped_mm; default: a "
                                       "loop over the local experts, the same numbers)")
    moe_router_num_groups: int | None = _f(None, "MoE: group-limited routing (Megatron's): the experts in this many "
                                                 "equal groups; each token picks --moe-router-group-topk groups by "
                                                 "the sum of the top-(topk / group-topk) scores in each, then its "
                                                 "top-k experts among them (DeepSeek-V3: 8 groups, 4 picked); 1 or "
                                                 "without --moe-router-group-topk: no grouping")
    moe_router_group_topk: int | None = _f(None, "MoE: group-limited routing: the groups each token picks (needs "
                                                 "--moe-router-num-groups)")
    moe_router_dtype: str | None = _f(None, "MoE: precision of the router: the gating GEMM, the scores and the "
                                            "weighted sum of the experts' outputs in fp32 or fp64 (default: the "
                                            "GEMM in the model dtype, the scores in fp32, the sum in the model "
                                            "dtype; fp32 changes no number of an fp32 run)", choices=["fp32", "fp64"])
    moe_input_jitter_eps: float | None = _f(None, "MoE: Megatron's router input jitter: not implemented here, "
                                                  "refused with one line")
    moe_permute_fusion: bool = _f(False, "MoE: Megatron's fused permutation kernels (Transformer Engine): accepted, "
                                         "no effect here: tokens are permuted by index_select / index_add (a start-up "
                                         "line says so)")
    moe_router_fusion: bool = _f(False, "MoE: Megatron's fused router kernels (Transformer Engine): accepted, no "
                                        "effect here: the routing runs unfused (a start-up line says so)")
    moe_shared_expert_overlap: bool = _f(False, "MoE: Megatron's overlap of the shared experts with the dispatch: "
                                                "accepted, no effect here: the shared experts run after the routed "
                                                "ones, the same numbers (a start-up line says so)")
    moe_layer_recompute: bool = _f(False, "MoE: recompute each MoE layer (router, dispatch, experts, shared experts) "
                                          "in the backward, keeping only its input (the same numbers)")
    # Multi-latent attention (Megatron-core's flags and meanings; megatron_po/models/mla.py, docs/mla.md)
    multi_latent_attention: bool = _f(False, "DeepSeek-V2/V3's multi-latent attention: keys and values up-projected "
                                             "per head from one shared low-rank latent (--kv-lora-rank), the query "
                                             "from its own (--q-lora-rank), a rotary part (--qk-pos-emb-head-dim) "
                                             "whose key is one head shared by all; --kv-channels and "
                                             "--position-embedding-type rope have no effect on it (its RoPE is "
                                             "--rope-type's); docs/mla.md")
    q_lora_rank: int | None = _f(None, "MLA: rank of the query's low-rank compression (default: none, the query "
                                       "projected from the hidden state, as Moonlight)")
    kv_lora_rank: int | None = _f(None, "MLA: rank of the key/value latent (default 32, Megatron's)")
    qk_head_dim: int | None = _f(None, "MLA: query/key head dimension without position information (default 128); a "
                                       "query/key head is this + --qk-pos-emb-head-dim")
    qk_pos_emb_head_dim: int | None = _f(None, "MLA: the rotary dimensions of a query/key head (default 64), the key's "
                                               "one head shared by all heads")
    v_head_dim: int | None = _f(None, "MLA: value head dimension (default 128)")
    rope_type: str | None = _f(None, "MLA's RoPE: yarn (the default with --multi-latent-attention; DeepSeek-V3's "
                                     "YaRN scaling) or rope (plain); plain attention takes only rope",
                               choices=["rope", "yarn"])
    rotary_scaling_factor: float = _f(1.0, "MLA: YaRN's context scaling factor s (DeepSeek-V3: 40); also in the "
                                           "softmax scale, mscale(s, --mscale-all-dim)^2 / sqrt(query/key head dim)")
    mscale: float = _f(1.0, "MLA: YaRN's mscale: cos/sin are scaled by mscale(s, mscale) / mscale(s, "
                            "--mscale-all-dim), mscale(s, m) = 0.1 m ln(s) + 1")
    mscale_all_dim: float = _f(0.0, "MLA: YaRN's mscale_all_dim (DeepSeek-V3: 1.0): see --mscale and "
                                    "--rotary-scaling-factor")
    yarn_original_max_position_embeddings: int | None = _f(None, "MLA's YaRN: the original (pretraining) context "
                                                                 "(default 4096, the value Megatron's MLA fixes)")
    yarn_beta_fast: float | None = _f(None, "MLA's YaRN: beta_fast, rotations below which a frequency is interpolated "
                                            "(default 32, the value Megatron's MLA fixes)")
    yarn_beta_slow: float | None = _f(None, "MLA's YaRN: beta_slow, rotations above which a frequency is kept "
                                            "(default 1, the value Megatron's MLA fixes)")
    yarn_correction_range_round_to_int: bool = _f(True, "MLA's YaRN: --no-yarn-correction-range-round-to-int keeps the "
                                                        "correction range's ends unrounded")
    mla_latent_norm_epsilon: float | None = _f(None, "MLA: the latent norms' epsilon (default: --norm-epsilon, as "
                                                     "Megatron's); DeepSeek's own code and transformers' DeepseekV3 "
                                                     "fix it at 1e-6 whatever the other norms' (Moonlight: 1e-5), "
                                                     "and import-hf sets it so")
    mla_down_proj_fusion: bool = _f(False, "MLA: no effect here: Megatron's fused query/key-value down-projection "
                                           "kernel switch (the same numbers); needs --multi-latent-attention as there")
    cache_mla_latents: bool = _f(False, "MLA: Megatron's latent KV cache of its inference engine, which conflicts with "
                                        "training there: refused with one line")
    # Multi-token prediction (DeepSeek-V3's; Megatron-core's flags and meanings; megatron_po/models/mtp.py, docs/mtp.md)
    mtp_num_layers: int | None = _f(None, "multi-token prediction: N sequential MTP modules on the last pipeline stage "
                                          "(DeepSeek-V3's); depth d combines the previous depth's states with the "
                                          "embedding of the tokens d ahead, runs one transformer layer of the model's "
                                          "last layer's kind and predicts token t+d+1 through the shared output layer "
                                          "(default: none)")
    mtp_loss_scaling_factor: float | None = _f(None, "MTP: the mean of the depths' losses times this factor is "
                                                     "added to the LM loss for the backward (default 0.1 with "
                                                     "--mtp-num-layers, as Megatron's; logged apart, not in lm loss)")


@dataclass
class ParallelConfig(ParallelRecipeFlags):
    tensor_model_parallel_size: int = _f(1, "tensor-parallel size")
    pipeline_model_parallel_size: int = _f(1, "pipeline-parallel size")
    num_layers_per_virtual_pipeline_stage: int | None = _f(None, "layers per virtual stage (interleaved pipeline)")
    sequence_parallel: bool = _f(False, "split LayerNorm/dropout activations along the sequence over TP ranks")
    pipeline_method: str = _f("1f1b", "pipeline schedule (synchronous: gpipe, 1f1b, zero-bubble zb-h1, zb-h2, zb-v) or "
                              "asynchronous method",
                              choices=["gpipe", "1f1b", "async-naive", "pipedream", "pipedream-2bw", "spectrain",
                                       "pipeoptim", "pipenag", "zb-h1", "zb-h2", "zb-v"])
    async_update_interval: int | None = _f(None, "asynchronous methods: a stage steps after every k of its backwards "
                                                 "(default 1; pipedream-2bw: the pipeline depth D)")
    async_drain_interval: int | None = _f(None, "asynchronous methods: drain the stream every this many iterations "
                                          "(checkpoints are taken at drains); default: at every --save-interval")
    pipeoptim_s_offset: int = _f(0, "PipeOptim: added to the schedule's staleness s (0 = paper, 1 = reference code)")
    pipeoptim_sgd_direction: str = _f("buffer", "PipeOptim with SGD momentum: the direction extrapolated",
                                      choices=["buffer", "lookahead"])
    pipeoptim_extrapolate_weight_decay: bool = _f(False, "PipeOptim: also extrapolate decoupled weight decay")
    weight_predictor: str = _f("linear", "PipeOptim: how far along ΔW to predict: linear = s·lr (paper), lr-schedule "
                               "= the schedule's next s lrs, rollout = the optimizer's recurrences rolled s steps",
                               choices=["linear", "lr-schedule", "rollout"])
    rollout_gradient: str = _f("first-moment", "--weight-predictor rollout: the next gradients' assumed mean",
                               choices=["first-moment", "zero-mean"])
    prediction_horizon: str = _f("full", "PipeOptim: extrapolate h(s) steps' worth: full = s, sqrt = √s (random-walk rule)",
                                 choices=["full", "sqrt"])
    delay_compensation_lambda: float = _f(0.0, "pipedream/pipeoptim: correct each gradient by "
                                          "λ·g⊙g⊙(W_live − W_used) before the step (DC-ASGD; 0 = off)")
    delay_compensation_adaptive: bool = _f(False, "delay compensation: divide λ by the gradient's RMS per tensor")
    staleness_lr_scaling: str = _f("none", "asynchronous methods: divide the lr of a step whose gradient is s steps "
                                   "stale by 1+s (inverse) or √(1+s) (inverse-sqrt)",
                                   choices=["none", "inverse", "inverse-sqrt"])
    async_error_feedback: bool = _f(False, "asynchronous methods: error-feedback correction of delayed updates, "
                                           "x ← x − u_t − s·(u_t − u_{t−1}) (Zmushko et al. 2026 at s = 1)")
    ddp_bucket_size: int = _f(40_000_000, "DDP gradient bucket size in elements")
    distributed_timeout_minutes: float = _f(10.0, "timeout of every collective and p2p operation; a dead rank is "
                                                  "detected (heartbeat) within half of it, at most 60 s")
    context_parallel_size: int = _f(1, "context-parallel size: every sequence split over this many ranks in 2 x CP "
                                       "chunks, rank i holding chunks i and 2CP-1-i (load-balanced causal "
                                       "attention); weights replicated, gradients averaged over DP x CP; "
                                       "docs/context_parallel.md")
    overlap_grad_reduce: bool = _f(False, "Megatron's DP gradient-reduce overlap: always on here (each bucket's "
                                          "reduce starts during the backward), so a documented no-op")
    overlap_p2p_communication: bool = _f(False, "Megatron's p2p overlap: always on here (pipeline sends and receives "
                                                "are posted asynchronously), so a documented no-op")
    distributed_backend: str | None = _f(None, "torch.distributed backend (default: nccl on CUDA, gloo on CPU; nccl "
                                               "needs CUDA)", choices=["nccl", "gloo"])
    expert_model_parallel_size: int = _f(1, "MoE: expert-parallel size: the experts split over this many ranks, "
                                            "carved out of the data-parallel ranks (Megatron's layout)")
    expert_tensor_parallel_size: int | None = _f(None, "MoE: tensor-parallel size of each expert (default "
                                                       "--tensor-model-parallel-size, as Megatron)")
    use_torch_fsdp2: bool = _f(False, "fully sharded data parallelism with PyTorch FSDP2 (torch.distributed.fsdp."
                                      "fully_shard): parameters, gradients and optimizer state sharded over the DP x "
                                      "CP ranks of each TP rank and stage (experts over their expert-DP ranks), each "
                                      "transformer layer gathered for its forward and backward (ZeRO-3; = "
                                      "--data-parallel-sharding-strategy optim_grads_params); docs/fsdp.md")
    torch_fsdp2_reshard_after_forward: bool = _f(True, "FSDP2 frees each layer's gathered weights after its forward "
                                                       "and gathers them again for its backward; this flag keeps "
                                                       "them from forward to backward instead (one gather per "
                                                       "micro-batch instead of two, whole weights of every layer in "
                                                       "flight; synchronous methods only)",
                                                 alias="--torch-fsdp2-no-reshard-after-forward")
    data_parallel_sharding_strategy: str = _f("no_shard", "what data parallelism shards (Megatron-FSDP's names): "
                                              "no_shard = DDP (nothing); optim = the distributed optimizer (ZeRO-1, "
                                              "= --use-distributed-optimizer); optim_grads = FSDP2 without resharding "
                                              "after forward (optimizer state and gradients sharded, parameters "
                                              "gathered once per micro-batch and kept until its backward); "
                                              "optim_grads_params = FSDP2 (= --use-torch-fsdp2); docs/fsdp.md",
                                              choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])


@dataclass
class DataConfig(DataRecipeFlags):
    data_path: list = _f([], "dataset prefix(es), optionally weighted: '0.3 A 0.7 B'", nargs="*")
    split: str = _f("969,30,1", "train,valid,test proportions of documents")
    mock_data: bool = _f(False, "synthetic random tokens instead of a corpus")
    data_cache_path: str | None = _f(None, "where to cache the dataset index files (default: next to the data)")
    tokenizer_type: str = _f("SentencePieceTokenizer", "tokenizer (Megatron's names; docs/data.md)",
                             choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = _f(None, "sentencepiece .model file, or a Hugging Face tokenizer directory or "
                                           "tokenizer.json (HuggingFaceTokenizer)")
    vocab_file: str | None = _f(None, "GPT2BPETokenizer: vocab.json")
    merge_file: str | None = _f(None, "GPT2BPETokenizer: merges.txt")
    vocab_size: int | None = _f(None, "vocabulary size (NullTokenizer)")
    num_workers: int = _f(0, "data loader worker processes preparing the next micro-batches in the background "
                             "(0: in the training process); the order is the same for every value")
    dataloader_type: str = _f("single", "sample order: single = the dataset's order once through, cyclic = "
                                        "reshuffled every pass (seeded by --seed and the pass)",
                              choices=["single", "cyclic"])
    mmap_bin_files: bool = _f(True, "memory-map the .bin files (--no-mmap-bin-files: read them with file reads)")
    eod_mask_loss: bool = _f(False, "no loss on the position after an end-of-document token (Megatron: loss mask 0 "
                                    "where the input token is EOD)")
    reset_position_ids: bool = _f(False, "position ids (learned or RoPE) restart at 0 after every "
                                         "end-of-document token")
    reset_attention_mask: bool = _f(False, "document-level causal mask: a token attends only to the earlier tokens "
                                           "of its own document")
    no_create_attention_mask_in_dataloader: bool = _f(False, "accepted, no-op: the causal mask is never built in "
                                                             "the data loader here (made in attention)")
    tiktoken_pattern: str | None = _f(None, "TikTokenizer's regex (v1/v2): no TikTokenizer here, so a clear error")


@dataclass
class TrainingConfig(TrainingRecipeFlags):
    micro_batch_size: int = _f(4, "samples per micro-batch")
    global_batch_size: int | None = _f(None, "samples per optimizer step (default micro_batch x DP)")
    train_iters: int = _f(100, "optimizer iterations")
    train_samples: int | None = _f(None, "train on this many samples instead of --train-iters (iterations = "
                                         "samples / global batch, after the ramp with --rampup-batch-size)")
    rampup_batch_size: list | None = _f(None, "START INCR SAMPLES: the global batch grows from START by INCR "
                                              "until it reaches --global-batch-size after SAMPLES samples", nargs=3)
    optimizer: str = _f("adamw", "optimizer",
                        choices=["adam", "adamw", "sgd", "nesterov", "rmsprop", "adagrad", "lion", "muon", "nadamw",
                                 "nag"])
    lr: float = _f(3e-4, "peak learning rate")
    min_lr: float = _f(0.0, "learning rate at the end of decay")
    lr_decay_style: str = _f("cosine", "learning-rate decay", choices=["constant", "linear", "cosine", "wsd"])
    lr_warmup_iters: int = _f(0, "linear warm-up iterations")
    lr_decay_iters: int | None = _f(None, "iterations of decay (default train_iters)")
    lr_wsd_decay_iters: int | None = _f(None, "WSD: iterations of the final decay (default 10%% of decay iters)")
    lr_warmup_samples: int = _f(0, "linear warm-up samples (with --train-samples)")
    lr_decay_samples: int | None = _f(None, "samples of decay (with --train-samples; default --train-samples)")
    lr_wsd_decay_samples: int | None = _f(None, "WSD: samples of the final decay (with --train-samples)")
    lr_warmup_fraction: float | None = _f(None, "warm-up as a fraction of the decay span (instead of "
                                                "--lr-warmup-iters/-samples)")
    decoupled_lr: float | None = _f(None, "peak lr of the input embedding and output layer, same schedule shape "
                                          "(synchronous methods)")
    decoupled_min_lr: float | None = _f(None, "final lr of the input embedding and output layer (with --decoupled-lr)")
    weight_decay: float = _f(0.01, "weight decay (decoupled for AdamW/Lion, L2 otherwise); not on biases and norms")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.999, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    sgd_momentum: float = _f(0.9, "SGD momentum (also nag's γ)")
    nadam_momentum_decay: float = _f(4e-3, "nadamw: torch NAdam's momentum_decay ψ, μ_t = β1(1 - 0.96^(tψ)/2)")
    muon_momentum: float = _f(0.95, "Muon: momentum of the hidden weight matrices")
    muon_use_nesterov: bool = _f(True, "Muon: Nesterov momentum (--no-muon-use-nesterov: plain momentum)")
    muon_num_ns_steps: int = _f(5, "Muon: Newton-Schulz iterations of the orthogonalisation")
    muon_scale_mode: str = _f("spectral", "Muon: update scale of a rows x cols matrix: spectral sqrt(max(rows, "
                                          "cols)), unit_rms_norm sqrt(rows/cols), shape_scaling sqrt(max(1, "
                                          "rows/cols))", choices=["spectral", "unit_rms_norm", "shape_scaling"])
    muon_extra_scale_factor: float = _f(0.2, "Muon: factor on the scale; 0.2 with spectral = Moonshot's "
                                             "0.2*sqrt(max(rows, cols)): AdamW's lr and weight decay carry over "
                                             "(Megatron's default: 1.0)")
    muon_fp32_matmul_prec: str = _f("medium", "Muon: Newton-Schulz matmul precision: medium = bf16, high = TF32 "
                                              "(fp32 where the device has none), highest = fp32 (low: Megatron's "
                                              "spelling that reaches torch as no level, i.e. fp32)",
                                    choices=["medium", "high", "highest", "low"])
    muon_coefficient_type: str = _f("simple", "Muon: Newton-Schulz coefficients: simple = Keller Jordan's (3.4445, "
                                              "-4.7750, 2.0315) every step; quintic = 5 tuned per-step sets (steps a "
                                              "multiple of 5); polar_express = Polar Express (>= 8 steps) "
                                              "(Megatron's default: quintic)",
                                    choices=["simple", "quintic", "polar_express"])
    muon_gram_newton_schulz: bool = _f(False, "Muon: Newton-Schulz through the Gram matrix on matrices at least twice "
                                              "as wide as tall (the MLP's): the same iterations, fewer FLOPs "
                                              "(optim/newton_schulz.py; opt-in: the default numerics are unchanged)")
    muon_split_qkv: bool = _f(True, "Muon: orthogonalise the fused QKV weight's Q, K and V matrices separately "
                                    "(--muon-no-split-qkv: as one matrix)", alias="--muon-no-split-qkv")
    muon_tp_mode: str = _f("duplicated", "Muon under tensor parallelism: duplicated = gather each matrix, "
                                         "orthogonalise it whole (exact); distributed = Gram matrices summed over "
                                         "TP (exact up to rounding); blockwise = each TP slice on its own (an "
                                         "approximation; Megatron's default)",
                           choices=["duplicated", "distributed", "blockwise"])
    clip_grad: float = _f(1.0, "clip gradients to this global L2 norm (0 disables)")
    seed: int = _f(1234, "random seed")
    eval_interval: int = _f(1000, "evaluate every this many iterations")
    eval_iters: int = _f(10, "validation micro-batch groups per evaluation")
    exit_interval: int | None = _f(None, "stop (after saving, with --save) once the iteration is a multiple of this")
    exit_duration_in_mins: float | None = _f(None, "stop (after saving, with --save) once training has run this "
                                                   "many minutes (agreed by all ranks after an iteration)")
    calculate_per_token_loss: bool = _f(False, "loss and gradients normalized by the global batch's loss tokens "
                                               "(not averaged per micro-batch)")
    manual_gc: bool = _f(False, "disable Python's automatic garbage collector; collect at --manual-gc-interval")
    manual_gc_interval: int = _f(0, "with --manual-gc: gc.collect() every this many iterations (0: only at "
                                    "evaluation and checkpoints)")
    empty_unused_memory_level: int = _f(0, "release cached device memory: 1 after each iteration, 2 also after "
                                           "evaluation (CUDA caching allocator; nothing to release on CPU)",
                                        choices=[0, 1, 2])
    cross_entropy_loss_fusion: bool = _f(False, "accepted: the output layer and the vocab-parallel cross entropy are "
                                                "fused here by default (--no-chunked-output-loss: the cross entropy "
                                                "is still one function, Megatron's fused kernel's math)")
    check_for_nan_in_loss_and_grad: bool = _f(True, "stop, naming the iteration, rank and stage, at a NaN/inf loss or "
                                                    "gradient (bf16/fp32) before the step; fp16 skips the step")
    deterministic: bool = _f(False, "bit-reproducible runs on GPUs: deterministic kernels (torch, cuDNN, cuBLAS "
                                    "workspace) and NCCL_ALGO=Ring; CPU runs are deterministic without it")


@dataclass
class PrecisionConfig:
    bf16: bool = _f(False, "bf16 model weights and activations; fp32 main params in the optimizer")
    fp16: bool = _f(False, "fp16 model weights with dynamic loss scaling; fp32 main params")
    accumulate_allreduce_grads_in_fp32: bool = _f(False, "accumulate and all-reduce gradients in fp32")
    loss_scale: float | None = _f(None, "constant loss scale (fp16); default: dynamic")
    initial_loss_scale: float = _f(2.0**32, "initial dynamic loss scale (fp16)")
    min_loss_scale: float = _f(1.0, "minimum dynamic loss scale (fp16)")
    loss_scale_window: int = _f(1000, "iterations without overflow before the loss scale grows (fp16)")
    hysteresis: int = _f(2, "overflows tolerated before the loss scale shrinks (fp16)")
    max_skipped_steps: int = _f(100, "stop (exit 2) after this many consecutive steps skipped for inf/NaN "
                                     "gradients (fp16/bf16 main-params optimizers; 0: no bound)")
    use_distributed_optimizer: bool = _f(False, "shard optimizer state and fp32 main params over DP (ZeRO-1)")
    overlap_param_gather: bool = _f(False, "overlap the distributed optimizer's parameter all-gather with the forward")
    grad_reduce_in_bf16: bool = _f(False, "with --bf16: gradients reduced and accumulated in bf16 (this project's "
                                          "default with --bf16; refuses --accumulate-allreduce-grads-in-fp32)")
    fp8_param_gather: bool = _f(False, "FP8 parameter all-gather (Transformer Engine, GPUs): not implemented, "
                                       "refused with one line")


@dataclass
class LoggingConfig(LoggingRecipeFlags):
    log_interval: int = _f(10, "log every this many iterations")
    metrics_file: str | None = _f(None, "append one JSON object per logged iteration to this file")
    wandb_project: str | None = _f(None, "Weights & Biases project (enables W&B)")
    wandb_exp_name: str | None = _f(None, "W&B run name")
    wandb_entity: str | None = _f(None, "W&B entity")
    wandb_save_dir: str | None = _f(None, "W&B local directory")
    tensorboard_dir: str | None = _f(None, "write TensorBoard event files (the same scalars as W&B) here")
    tensorboard_log_interval: int = _f(1, "write TensorBoard/W&B scalars on every this-many-th logged iteration")
    log_params_norm: bool = _f(False, "log the L2 norm of all parameters (params_norm)")
    log_num_zeros_in_grad: bool = _f(False, "log the number of zero gradient entries (num_zeros_in_grad)")
    profile: bool = _f(False, "torch.profiler trace of iterations --profile-step-start..end (TensorBoard/Perfetto "
                              "JSON under --tensorboard-dir or ./profile)")
    profile_step_start: int = _f(10, "first profiled iteration")
    profile_step_end: int = _f(12, "iteration where profiling stops")
    log_throughput: bool = _f(False, "also log the model TFLOP/s per GPU (per rank on CPU) and, with a known peak, MFU")
    peak_tflops: float | None = _f(None, "peak dense TFLOP/s of one device for MFU (default: known GPUs by name)")
    timing_log_level: int = _f(0, "timers to log: 0 none, 1 forward-backward/grad-sync/optimizer, 2 also "
                                  "forward/backward compute, p2p and weight prediction", choices=[0, 1, 2])


@dataclass
class CheckpointConfig(CheckpointRecipeFlags):
    save: str | None = _f(None, "checkpoint directory to save to")
    load: str | None = _f(None, "checkpoint directory to resume from (latest checkpoint)")
    ckpt_format: str = _f("torch_dist", "checkpoint format: torch_dist (torch.distributed.checkpoint), the only one",
                          choices=["torch_dist"])
    use_checkpoint_args: bool = _f(False, "take the model-architecture flags from the checkpoint in --load")
    no_save_optim: bool = _f(False, "do not save the optimizer state (weights only; resume needs --no-load-optim)")
    no_save_rng: bool = _f(False, "do not save the random generators' states")
    save_interval: int | None = _f(None, "save every this many iterations (and at the end)")
    ckpt_step: int | None = _f(None, "load the checkpoint of this iteration instead of the latest")
    keep_last: int | None = _f(None, "after each save, delete all but the newest N checkpoints (never the tracked one)")
    no_load_optim: bool = _f(False, "do not load the optimizer state (fresh optimizer, weights loaded); "
                                    "without --load nothing to do, as in Megatron")
    no_load_rng: bool = _f(False, "do not load the random generators' states; without --load nothing to do, "
                                  "as in Megatron")
    finetune: bool = _f(False, "load the weights only: iteration and consumed samples restart at 0, "
                               "optimizer and random states are not loaded")
    no_verify_checkpoint: bool = _f(False, "load without checking the checkpoint's files against its checksums.json "
                                           "(saves one read of the checkpoint at SHA-256 speed)")


@dataclass
class NMTConfig:
    """Encoder-decoder translation (pretrain_nmt.py, tools/translate.py); pretrain_gpt.py ignores it.
    With pretrain_nmt.py `--seq-length` bounds the source side and `--num-layers` is the default depth of
    both stacks (Megatron's T5 convention); `normalize_nmt` turns them into the stacked layer count."""
    encoder_num_layers: int | None = _f(None, "NMT: encoder layers (default --num-layers)")
    decoder_num_layers: int | None = _f(None, "NMT: decoder layers (default --num-layers)")
    decoder_seq_length: int | None = _f(None, "NMT: longest target sequence in tokens, BOS/EOS included "
                                              "(default --seq-length, which bounds the source)")
    src_lang: str = _f("en", "NMT: source language (reads <data-path>_<split>_<src-lang>.bin/.idx)")
    tgt_lang: str = _f("fr", "NMT: target language (reads <data-path>_<split>_<tgt-lang>.bin/.idx)")
    tgt_tokenizer_model: str | None = _f(None, "NMT: target-side sentencepiece model (default --tokenizer-model: "
                                               "one joint vocabulary)")
    untie_encoder_decoder_embeddings: bool = _f(False, "NMT: separate source and target word embeddings "
                                                       "(required with --tgt-tokenizer-model)")
    max_tokens: int | None = _f(None, "NMT: cap a micro-batch at this many padded tokens of its longer side too "
                                      "(token-based batching; --micro-batch-size caps its sentences)")
    label_smoothing: float = _f(0.1, "NMT: label smoothing of the cross entropy")
    eval_bleu_sentences: int | None = _f(None, "NMT: validation sentences greedily decoded for BLEU at each "
                                               "evaluation (default: all)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    nmt: NMTConfig = field(default_factory=NMTConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------
# Flags generated from the tree
# --------------------------------------------------------------------------------------------------


def _sections(cfg_cls=Config):
    hints = get_type_hints(cfg_cls)
    for f in dataclasses.fields(cfg_cls):
        yield f.name, hints[f.name]


def _scalar_type(tp):
    """`int | None` -> int; `list` -> str (items)."""
    if get_origin(tp) is not None and type(None) in get_args(tp):
        tp = next(a for a in get_args(tp) if a is not type(None))
    return str if tp is list else tp


def build_parser(description: str = "megatron_po") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    # argparse takes "-1e-3" for an option (its negative-number pattern has no exponent) and says "expected
    # one argument": every negative number reaches the validators, whose line names the rule it breaks.
    parser._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf$")
    for section, section_cls in _sections():
        group = parser.add_argument_group(section)
        hints = get_type_hints(section_cls)
        # the section's own fields first, then those config_recipe.py mixes in (dataclasses lists a base's first)
        own = vars(section_cls)["__annotations__"]
        for f in sorted(dataclasses.fields(section_cls), key=lambda f: f.name not in own):
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_ = f.metadata.get("help", "")
            tp = _scalar_type(hints[f.name])
            alias = [f.metadata["alias"]] if "alias" in f.metadata else []
            if tp is bool:
                if default:
                    group.add_argument("--no-" + f.name.replace("_", "-"), *alias, dest=f.name, action="store_false",
                                       help=help_)
                    # the positive spelling (Megatron accepts e.g. --check-for-nan-in-loss-and-grad): the default
                    group.add_argument(flag, dest=f.name, action="store_true", help=argparse.SUPPRESS)
                else:
                    group.add_argument(flag, *alias, dest=f.name, action="store_true", help=help_)
                continue
            kwargs = dict(dest=f.name, type=tp, default=default, help=help_)
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            if "nargs" in f.metadata:
                kwargs["nargs"] = f.metadata["nargs"]
            group.add_argument(flag, *alias, **kwargs)
    return parser


class _ArgumentError(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise _ArgumentError(message)


def parse_args(argv=None, description: str = "megatron_po") -> Config:
    """Parse flags into a Config. Unknown or malformed flags raise ConfigError (one line)."""
    parser = build_parser(description)
    parser.__class__ = _RaisingParser
    try:
        ns = parser.parse_args(argv)
    except _ArgumentError as e:
        raise ConfigError(str(e)) from None
    return config_from_namespace(ns)


def config_from_namespace(ns: argparse.Namespace) -> Config:
    values = vars(ns)
    # Megatron's GPT-3 example passes --vocab-file and --merge-file without --tokenizer-type: GPT-2 BPE.
    if values["tokenizer_type"] == "SentencePieceTokenizer" and values["tokenizer_model"] is None \
            and values["vocab_file"] is not None and values["merge_file"] is not None:
        values = dict(values, tokenizer_type="GPT2BPETokenizer")
    if values["data_parallel_sharding_strategy"] == "optim":  # Megatron-FSDP's name of the distributed optimizer
        values = dict(values, use_distributed_optimizer=True)
    if values["use_rotary_position_embeddings"]:  # Megatron's older spelling, which overrides the newer flag
        values = dict(values, position_embedding_type="rope")
    sections = {}
    for section, section_cls in _sections():
        sections[section] = section_cls(**{f.name: values[f.name] for f in dataclasses.fields(section_cls)})
    return Config(**sections)


# --------------------------------------------------------------------------------------------------
# Derived values
# --------------------------------------------------------------------------------------------------


ASYNC_METHODS = ("async-naive", "pipedream", "pipedream-2bw", "spectrain", "pipeoptim", "pipenag")


def is_async(cfg: "Config") -> bool:
    return cfg.parallel.pipeline_method in ASYNC_METHODS


def uses_fsdp2(cfg: "Config") -> bool:
    """FSDP2 shards this run's data parallelism: --use-torch-fsdp2, or the sharding strategies that shard
    gradients (optim_grads, optim_grads_params)."""
    p = cfg.parallel
    return p.use_torch_fsdp2 or p.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")


def fsdp2_reshard_after_forward(cfg: "Config") -> bool:
    """FSDP2 frees each gathered layer after its forward and gathers it again for its backward (optim_grads and
    --torch-fsdp2-no-reshard-after-forward keep it instead)."""
    p = cfg.parallel
    return p.torch_fsdp2_reshard_after_forward and p.data_parallel_sharding_strategy != "optim_grads"


def ffn_hidden_size(m: ModelConfig) -> int:
    if m.ffn_hidden_size is not None:
        return m.ffn_hidden_size
    if m.swiglu:  # keep the MLP's parameter count of a 4h GELU MLP, rounded to a multiple of 64
        return ((int(8 * m.hidden_size / 3) + 63) // 64) * 64
    return 4 * m.hidden_size


def model_config_from_dict(model: dict) -> ModelConfig:
    """A saved `config["model"]` dict as a ModelConfig; fields added after it was saved take their defaults."""
    return ModelConfig(**{k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__})


def kv_channels(m: ModelConfig) -> int:
    """Dimension of one attention head (Megatron's --kv-channels, default hidden / heads)."""
    return m.kv_channels if m.kv_channels is not None else m.hidden_size // m.num_attention_heads


def num_query_groups(m: ModelConfig) -> int:
    """Key/value heads: --num-query-groups with --group-query-attention, else one per attention head."""
    return m.num_query_groups if m.group_query_attention else m.num_attention_heads


def recompute_granularity(m: ModelConfig) -> str | None:
    """The activation recomputation in effect: --recompute-activations is Megatron's alias of selective."""
    return "selective" if m.recompute_activations else m.recompute_granularity


# the --recompute-modules this code implements (Megatron-core's names): the attention core, the dense MLP, each MoE
# layer, the MoE layers' shared experts
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts")


def recompute_modules(m: ModelConfig) -> tuple[str, ...]:
    """The modules selective recomputation recomputes: --recompute-modules, Megatron's default core_attn; none
    without selective (where Megatron ignores the flag too)."""
    if recompute_granularity(m) != "selective":
        return ()
    return tuple(m.recompute_modules) if m.recompute_modules is not None else ("core_attn",)


def recomputes_core_attention(m: ModelConfig) -> bool:
    """Whether the attention core, softmax(QKᵀ)V, is recomputed in the backward."""
    return "core_attn" in recompute_modules(m)


def recomputes_moe_layers(m: ModelConfig) -> bool:
    """Whether each MoE layer is recomputed in the backward: --moe-layer-recompute, or --recompute-modules moe
    (Megatron's --moe-layer-recompute is its deprecated spelling)."""
    return m.moe_layer_recompute or "moe" in recompute_modules(m)


MTP_LOSS_SCALING_FACTOR = 0.1  # Megatron's default of --mtp-loss-scaling-factor


def mtp_loss_scale(m: ModelConfig) -> float:
    """--mtp-loss-scaling-factor in effect (Megatron's 0.1 when not given); None-default so that the flag given
    without --mtp-num-layers can be refused."""
    return MTP_LOSS_SCALING_FACTOR if m.mtp_loss_scaling_factor is None else m.mtp_loss_scaling_factor


def fp8_backend(m: ModelConfig) -> str | None:
    """Who runs FP8 (None: FP8 off): "te" (Transformer Engine's layers) or "torchao" (the local layers)."""
    if m.fp8_format is None:
        return None
    if m.fp8_backend == "auto":
        return "te" if m.transformer_impl == "transformer_engine" else "torchao"
    return m.fp8_backend


def fp8_recipe(m: ModelConfig) -> str | None:
    """--fp8-recipe, or its backend's default: delayed (Transformer Engine) or tensorwise (torchao)."""
    backend = fp8_backend(m)
    if backend is None:
        return None
    return m.fp8_recipe or ("delayed" if backend == "te" else "tensorwise")


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """Replicas that read different samples: the world over TP x PP x CP (the CP ranks of one DP rank share
    its samples, each holding a part of every sequence)."""
    p = cfg.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)


def num_microbatches(cfg: Config, world_size: int) -> int:
    dp = data_parallel_size(cfg, world_size)
    return global_batch_size(cfg, world_size) // (cfg.training.micro_batch_size * dp)


def global_batch_size(cfg: Config, world_size: int) -> int:
    dp = data_parallel_size(cfg, world_size)
    return cfg.training.global_batch_size or cfg.training.micro_batch_size * dp


def update_interval(cfg: Config) -> int:
    """--async-update-interval k, defaulted: D for pipedream-2bw (it needs m >= D), else 1."""
    p = cfg.parallel
    if p.async_update_interval is not None:
        return p.async_update_interval
    return p.pipeline_model_parallel_size if p.pipeline_method == "pipedream-2bw" else 1


def rampup_batch_size(cfg: Config) -> tuple[int, int, int] | None:
    """--rampup-batch-size START INCR SAMPLES as ints (None without it); ConfigError when not integers."""
    r = cfg.training.rampup_batch_size
    if r is None:
        return None
    try:
        return tuple(int(x) for x in r)
    except ValueError:
        raise ConfigError(f"--rampup-batch-size takes three integers START INCR SAMPLES, got {' '.join(r)}") from None


def virtual_pipeline_size(cfg: Config) -> int:
    """Model chunks per pipeline rank (1 without interleaving): --pipeline-model-parallel-layout's stage count / D,
    --num-virtual-stages-per-pipeline-rank, or Megatron's (--num-layers + the embedding and loss where counted) / (D x
    --num-layers-per-virtual-pipeline-stage)."""
    p = cfg.parallel
    if p.pipeline_model_parallel_layout is not None:
        return max(1, layout_stage_count(p.pipeline_model_parallel_layout) // p.pipeline_model_parallel_size)
    if p.num_virtual_stages_per_pipeline_rank is not None:
        return p.num_virtual_stages_per_pipeline_rank
    if p.num_layers_per_virtual_pipeline_stage is None:
        return 1
    counted = (cfg.model.num_layers + int(p.account_for_embedding_in_pipeline_split)
               + int(p.account_for_loss_in_pipeline_split))
    return counted // (p.pipeline_model_parallel_size * p.num_layers_per_virtual_pipeline_stage)


def normalize_nmt(cfg: Config) -> Config:
    """pretrain_nmt.py's reading of the layer flags: the encoder and decoder depths default to --num-layers
    (Megatron's T5 convention), and `model.num_layers` becomes their sum, the stacked layer count that the
    pipeline splits (encoder layers 0..Le-1, then decoder layers). Idempotent: both depths are explicit
    afterwards, so a saved config normalizes to itself."""
    n = cfg.nmt
    if n.encoder_num_layers is None:
        n.encoder_num_layers = cfg.model.num_layers
    if n.decoder_num_layers is None:
        n.decoder_num_layers = cfg.model.num_layers
    cfg.model.num_layers = n.encoder_num_layers + n.decoder_num_layers
    if n.decoder_seq_length is None:
        n.decoder_seq_length = cfg.model.seq_length
    return cfg
