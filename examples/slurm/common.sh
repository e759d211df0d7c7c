# Sourced by pretrain_gpt.sbatch and pretrain_gpt_srun.sbatch: go to the checkout, prepare the bundled
# corpus if it is the one used, and build the pretrain_gpt.py flags (ARGS) from environment variables.
# Every variable has a tiny CPU default; the GPU-scale values to use instead are in the comments.
#
# Auto-resume: --save and --load point at the same $RUN_DIR/checkpoints, so a job that Slurm requeues
# (--requeue: preemption, node failure, `scontrol requeue`) or that you submit again with the same
# RUN_DIR continues from the latest checkpoint (losing at most SAVE_INTERVAL iterations).

REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$REPO" || exit 2
if [ ! -f pretrain_gpt.py ]; then
  echo "error: $REPO is not the megatron_po checkout: submit from its root or set REPO=/path/to/it" >&2
  exit 2
fi
PYTHON=${PYTHON:-.venv/bin/python}       # the environment of `bash scripts/setup_env.sh`
if ! command -v "$PYTHON" >/dev/null; then
  echo "error: PYTHON=$PYTHON not found: run 'bash scripts/setup_env.sh' first or set PYTHON" >&2
  exit 2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME:-pretrain_gpt}}   # checkpoints, metrics.jsonl, index cache
DATA_PATH=${DATA_PATH:-examples/data/bible_text_document}   # your corpus: my_corpus_text_document
TOKENIZER_MODEL=${TOKENIZER_MODEL:-examples/data/bible.model}
TP=${TP:-1}                               # GPUs: 2-8, within a node
PP=${PP:-1}                               # GPUs: so that a stage's layers fit in memory
METHOD=${METHOD:-1f1b}                    # gpipe, 1f1b, async-naive, pipedream, pipedream-2bw, spectrain, pipeoptim
NUM_LAYERS=${NUM_LAYERS:-4}               # GPUs: 24
HIDDEN_SIZE=${HIDDEN_SIZE:-128}           # GPUs: 1024
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}  # GPUs: 16
SEQ_LENGTH=${SEQ_LENGTH:-128}             # GPUs: 1024-4096
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-8}   # GPUs: 4-16
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-32}  # GPUs: 256-1024
TRAIN_ITERS=${TRAIN_ITERS:-300}           # GPUs: 100000
LR=${LR:-1e-3}                            # GPUs: 3e-4 with LR_WARMUP_ITERS=2000
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-20}
SAVE_INTERVAL=${SAVE_INTERVAL:-100}       # GPUs: 1000
EVAL_INTERVAL=${EVAL_INTERVAL:-100}       # GPUs: 1000
LOG_INTERVAL=${LOG_INTERVAL:-20}          # GPUs: 10-100
# Also: WANDB_PROJECT (and WANDB_EXP_NAME, WANDB_ENTITY; WANDB_MODE=offline on nodes without internet),
# TENSORBOARD_DIR, and any flag as an argument of the script: `sbatch ... pretrain_gpt.sbatch --bf16`.

if [ "$DATA_PATH" = examples/data/bible_text_document ] && [ ! -f "$DATA_PATH.idx" ]; then
  bash examples/data/prepare_bible.sh "$PYTHON" || exit 1   # once, in the batch step, before the ranks start
fi
mkdir -p "$RUN_DIR"

ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --pipeline-method "$METHOD"
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_ATTENTION_HEADS"
  --seq-length "$SEQ_LENGTH" --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$(awk "BEGIN {print $LR / 10}")" --lr-decay-style cosine
  --lr-warmup-iters "$LR_WARMUP_ITERS" --weight-decay 0.1 --clip-grad 1.0
  --data-path "$DATA_PATH" --tokenizer-model "$TOKENIZER_MODEL" --split 969,30,1
  --data-cache-path "$RUN_DIR/cache"
  --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters 4 --log-throughput
  --metrics-file "$RUN_DIR/metrics.jsonl"
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval "$SAVE_INTERVAL"
)
case "$METHOD" in gpipe|1f1b) ;; *) ARGS+=(--untie-embeddings-and-output-weights) ;; esac  # stages step apart
[ -n "${WANDB_PROJECT:-}" ] && ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-save-dir "$RUN_DIR"
                                     --wandb-exp-name "${WANDB_EXP_NAME:-${SLURM_JOB_NAME:-pretrain_gpt}-$SLURM_JOB_ID}")
[ -n "${WANDB_ENTITY:-}" ] && ARGS+=(--wandb-entity "$WANDB_ENTITY")
[ -n "${TENSORBOARD_DIR:-}" ] && ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST: run dir $RUN_DIR"
