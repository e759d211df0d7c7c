#!/usr/bin/env bash
# A tiny mixture of experts on the bundled World English Bible, on 2 CPU processes with expert parallelism 2:
# 8 experts per MoE layer, top-2 softmax routing, the first layer dense (Megatron's --moe-layer-freq list form),
# alltoall dispatch, the local experts as one grouped GEMM, load-balancing loss and z-loss. The log shows each
# MoE layer's aux loss, z-loss, tokens per expert (max / mean) and dropped tokens (docs/moe.md). Then the
# checkpoint (experts sharded by EP, saved as global tensors) is exported to a Hugging Face Qwen2-MoE model.
# About 4 minutes on 2 CPU cores.
#
# Extra flags go through (later flags win): `bash examples/moe_tiny.sh --moe-expert-capacity-factor 1.0`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DATA=examples/data
OUT=${OUT:-runs/moe_tiny}
mkdir -p "$OUT"

bash examples/data/prepare_bible.sh $PY

$PY -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_gpt.py \
    --expert-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear \
    --untie-embeddings-and-output-weights \
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-layer-freq '([0]*1+[1]*3)' \
    --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall --moe-grouped-gemm \
    --micro-batch-size 8 --global-batch-size 32 \
    --train-iters ${TRAIN_ITERS:-300} --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
    --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path $DATA/bible_text_document --split 969,30,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/bible.model \
    --data-cache-path $OUT/cache \
    --log-interval 20 --eval-interval 100 --eval-iters 4 --log-throughput \
    --metrics-file $OUT/metrics.jsonl --save $OUT/checkpoints --save-interval 150 "$@"

# What no Hugging Face MoE class can hold (e.g. a capacity given above) is refused with one line.
$PY tools/checkpoint_convert.py export-hf --load $OUT/checkpoints --out $OUT/hf --no-progress || true
