#!/usr/bin/env bash
# Long sequences on CPU: a tiny Llama-style GPT (RoPE, RMSNorm, SwiGLU, grouped-query attention) on the bundled
# World English Bible at 2,048 tokens per sequence, every sequence split over 2 context-parallel ranks (ring
# attention), in 2 pipeline stages trained with PipeOptim: 4 processes. About 5 minutes on 2 CPU cores at the
# default 100 iterations (docs/context_parallel.md).
#
# On GPUs: raise the model and --seq-length (e.g. the 1.3B GPT of bench/gpu at 16,384 tokens with
# --context-parallel-size 2 --bf16), set --nproc-per-node to TP x CP x DP x PP; the ring then runs its blocks
# through PyTorch's memory-efficient attention kernel. Extra flags go through:
# `bash examples/gpt_long_context.sh --cp-comm-type allgather`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DATA=examples/data
OUT=${OUT:-runs/gpt_long_context}
mkdir -p "$OUT"

bash examples/data/prepare_bible.sh $PY

$PY -m torch.distributed.run --standalone --nproc-per-node 4 pretrain_gpt.py \
    --context-parallel-size 2 --cp-comm-type p2p \
    --pipeline-model-parallel-size 2 --pipeline-method pipeoptim --untie-embeddings-and-output-weights \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2 \
    --position-embedding-type rope --no-position-embedding --normalization RMSNorm --swiglu \
    --seq-length 2048 --micro-batch-size 1 --global-batch-size 4 \
    --train-iters ${TRAIN_ITERS:-100} --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 \
    --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path $DATA/bible_text_document --split 969,30,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/bible.model \
    --data-cache-path $OUT/cache \
    --log-interval 10 --eval-interval 50 --eval-iters 2 --log-throughput \
    --metrics-file $OUT/metrics.jsonl --save $OUT/checkpoints --save-interval 50 "$@"
