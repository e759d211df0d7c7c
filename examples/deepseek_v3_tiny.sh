#!/usr/bin/env bash
# A tiny DeepSeek-V3 on the bundled World English Bible, on 2 CPU processes with expert parallelism 2. The model
# flags are DeepSeek-V3's Megatron recipe (THUDM/slime scripts/models/deepseek-v3.sh) flag for flag with the sizes
# shrunk (4 layers of hidden 128, the first dense; 16 experts of 64 in 8 groups), the load-balancing settings of
# NVIDIA's Megatron-MoE-ModelZoo DeepSeek-V3.yaml (aux loss 1e-4, expert bias moved by 1e-3 per step; slime's RL
# recipe sets both to 0) and its multi-token prediction (one depth, weight 0.1):
# multi-latent attention (query latent 64, key/value latent 32, YaRN factor 40), top-8 routing within the best 4 of
# 8 expert groups, sigmoid scores with the expert bias, a shared expert, alltoall dispatch, the local experts as one
# grouped GEMM. The log shows the MTP loss beside the LM loss and each MoE layer's numbers (docs/moe.md,
# "DeepSeek-V3 family"), then the checkpoint is exported to Hugging Face. About 2.5-3.4 s an iteration on 2 CPU
# cores shared with other work (measured at 4 iterations), so some 15 minutes for the 300.
#
# Extra flags go through (later flags win): `bash examples/deepseek_v3_tiny.sh --pipeline-model-parallel-size 2
# --expert-model-parallel-size 1 --pipeline-method pipeoptim`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DATA=examples/data
OUT=${OUT:-runs/deepseek_v3_tiny}
mkdir -p "$OUT"

bash examples/data/prepare_bible.sh $PY

$PY -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_gpt.py \
    --expert-model-parallel-size 2 \
    --disable-bias-linear --num-layers 4 --hidden-size 128 --ffn-hidden-size 256 --num-attention-heads 4 \
    --kv-channels 32 --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --swiglu \
    --untie-embeddings-and-output-weights \
    --multi-latent-attention --q-lora-rank 64 --kv-lora-rank 32 --qk-head-dim 32 --qk-pos-emb-head-dim 16 \
    --v-head-dim 32 --qk-layernorm --rotary-scaling-factor 40 --rotary-base 10000 --mscale 1.0 --mscale-all-dim 1.0 \
    --attention-softmax-in-fp32 --no-rope-fusion \
    --num-experts 16 --moe-layer-freq '[0,1,1,1]' --moe-ffn-hidden-size 64 --moe-router-topk 8 \
    --moe-shared-expert-intermediate-size 64 --moe-router-pre-softmax --moe-router-score-function sigmoid \
    --moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall \
    --moe-aux-loss-coeff 1e-4 --moe-router-bias-update-rate 1e-3 --moe-router-group-topk 4 --moe-router-num-groups 8 \
    --moe-grouped-gemm --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 --moe-permute-fusion \
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 \
    --seq-length 128 --micro-batch-size 8 --global-batch-size 32 \
    --train-iters ${TRAIN_ITERS:-300} --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
    --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path $DATA/bible_text_document --split 969,30,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/bible.model \
    --data-cache-path $OUT/cache \
    --log-interval 20 --eval-interval 100 --eval-iters 4 --log-throughput \
    --metrics-file $OUT/metrics.jsonl --save $OUT/checkpoints --save-interval 150 "$@"

# The checkpoint as a Hugging Face DeepSeek-V3 (DeepseekV3ForCausalLM; its MTP depth as the Hub's layer 4).
$PY tools/checkpoint_convert.py export-hf --load $OUT/checkpoints --out $OUT/hf --no-progress
