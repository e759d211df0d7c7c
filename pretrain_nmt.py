"""Train an encoder-decoder translation model. Launch like pretrain_gpt.py (torchrun, or srun under Slurm):

    python tools/preprocess_nmt.py --input pairs.jsonl --src-lang en --tgt-lang fr --output-prefix data/en_fr ...
    torchrun --nproc-per-node 4 pretrain_nmt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --encoder-num-layers 4 --decoder-num-layers 4 --data-path data/en_fr --src-lang en --tgt-lang fr \
        --tokenizer-model data/en_fr.model --max-tokens 4096 ...

The same flags, loop, checkpoints and pipeline methods as pretrain_gpt.py, plus the NMT section of
`--help` (--encoder-num-layers, --decoder-num-layers, --decoder-seq-length, --max-tokens, --label-smoothing,
--eval-bleu-sentences, ...). Every --eval-interval it reports the validation loss and the greedy-decoding
BLEU of the validation split. See megatron_po/nmt_workload.py.
"""

import sys

from megatron_po.nmt_workload import NMTWorkload
from megatron_po.training import run_main

if __name__ == "__main__":
    sys.exit(run_main(sys.argv[1:], description="Train an encoder-decoder translation model (megatron_po)",
                      workload_cls=NMTWorkload))
