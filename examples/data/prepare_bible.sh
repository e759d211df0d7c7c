#!/usr/bin/env bash
# The bundled corpus, ready to train on: a 4000-token sentencepiece BPE tokenizer trained on the World
# English Bible (bible_web.en.jsonl.gz, public domain) and the corpus preprocessed into Megatron
# .bin/.idx (bible_text_document). Skips whatever already exists. About a minute on 2 CPU cores.
#
#   bash examples/data/prepare_bible.sh [python]      # default python: .venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-.venv/bin/python}
DATA=examples/data
if [ ! -f $DATA/bible.model ]; then
  "$PY" tools/train_tokenizer.py --input $DATA/bible_web.en.jsonl.gz --json-keys text \
      --vocab-size 4000 --model-type bpe --output-prefix $DATA/bible
fi
if [ ! -f $DATA/bible_text_document.idx ]; then
  "$PY" tools/preprocess_data.py --input $DATA/bible_web.en.jsonl.gz --json-keys text \
      --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/bible.model \
      --output-prefix $DATA/bible --append-eod --workers 2
fi
