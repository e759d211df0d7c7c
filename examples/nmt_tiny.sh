#!/usr/bin/env bash
# Machine translation end to end on CPU: the bundled English-French Bible (31k verse pairs, public domain)
# preprocessed with held-out books, a small encoder-decoder transformer trained with torchrun on 2
# processes (data parallel 2), greedy-decoding validation BLEU every --eval-interval, then the held-out
# test books translated with beam search and scored (BLEU, chrF), beside the copy-the-source baseline.
#
# Budget: 15 minutes on 2 CPU cores including preprocessing (see docs/nmt.md for the
# figures measured here). On GPUs: raise --hidden-size/--encoder-num-layers/--decoder-num-layers/
# --max-tokens and --train-iters, set --nproc-per-node to your GPU count, add --bf16.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT:-runs/nmt_tiny}
DATA=$OUT/data  # preprocessed corpus and tokenizer (runs/ is not tracked)
mkdir -p "$DATA"
rm -rf "$OUT/checkpoints" "$OUT/metrics.jsonl"  # a fresh run each time

# Validation: Ruth, Philippians, James; test: Jonah, Colossians, 1 John (whole books, ~300 verses each).
if [ ! -f $DATA/bible_en_fr.json ]; then
  $PY tools/preprocess_nmt.py --input examples/data/bible_web_lsg1910.en-fr.jsonl.gz --src-lang en --tgt-lang fr \
      --doc-key ref --doc-regex '^(.+?) [0-9]+:[0-9]+$' \
      --valid-docs Ruth Philippians James --test-docs Jonah Colossians 1John \
      --vocab-size 4000 --output-prefix $DATA/bible_en_fr --workers 2
fi

# Init std 0.08 ~ 1/sqrt(hidden): Megatron's default 0.02 suits hidden sizes in the thousands; at 128 it
# leaves the cross-attention untrained for epochs (the decoder stays a language model of French).
$PY -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_nmt.py \
    --encoder-num-layers 3 --decoder-num-layers 3 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4 \
    --position-embedding-type rope --init-method-std 0.08 --seq-length 128 --decoder-seq-length 144 \
    --micro-batch-size 16 --max-tokens 1024 --global-batch-size 32 \
    --train-iters ${TRAIN_ITERS:-2000} --lr 2e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 100 \
    --weight-decay 0.01 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 --label-smoothing 0.1 \
    --data-path $DATA/bible_en_fr --src-lang en --tgt-lang fr --tokenizer-model $DATA/bible_en_fr.model \
    --log-interval 100 --eval-interval 1000 \
    --metrics-file $OUT/metrics.jsonl --save $OUT/checkpoints "$@"

echo "> test books: beam search with the trained model, then the copy-the-source baseline"
$PY tools/translate.py --load $OUT/checkpoints --input $DATA/bible_en_fr_test.en --reference $DATA/bible_en_fr_test.fr \
    --beam-size 4 --output $OUT/test.hyp.fr --no-progress
$PY tools/translate.py --copy-source --input $DATA/bible_en_fr_test.en --reference $DATA/bible_en_fr_test.fr \
    --output /dev/null
echo "> validation books: the copy-the-source baseline of the logged val BLEU"
$PY tools/translate.py --copy-source --input $DATA/bible_en_fr_valid.en --reference $DATA/bible_en_fr_valid.fr \
    --output /dev/null
