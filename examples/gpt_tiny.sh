#!/usr/bin/env bash
# The main job, end to end on CPU: sentencepiece tokenizer on the bundled World English Bible,
# Megatron .bin/.idx preprocessing, then a tiny GPT pretrained with torchrun on 4 processes
# (tensor parallel 2 x data parallel 2). About 3 minutes on 2 CPU cores.
#
# On GPUs: raise --hidden-size/--num-layers/--seq-length/--micro-batch-size/--global-batch-size (e.g.
# 24 layers, 1024 hidden, 16 heads, seq 1024, micro-batch 8, global batch 256), set --nproc-per-node to
# your GPU count and add --bf16; the code picks cuda+nccl by itself and reports MFU for known GPUs.
# Extra flags go through: `bash examples/gpt_tiny.sh --wandb-project my-project --tensorboard-dir tb`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DATA=examples/data
OUT=${OUT:-runs/gpt_tiny}
mkdir -p "$OUT"

bash examples/data/prepare_bible.sh $PY

# Documents stay in canonical order, so --split holds out the last chapters (Jude, Revelation ...) for
# validation: whole chapters of the last books, never random verses.
$PY -m torch.distributed.run --standalone --nproc-per-node 4 pretrain_gpt.py \
    --tensor-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 8 --global-batch-size 32 \
    --train-iters ${TRAIN_ITERS:-300} --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
    --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path $DATA/bible_text_document --split 969,30,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/bible.model \
    --data-cache-path $OUT/cache \
    --log-interval 20 --eval-interval 100 --eval-iters 4 --log-throughput \
    --metrics-file $OUT/metrics.jsonl --save $OUT/checkpoints --save-interval 150 "$@"
