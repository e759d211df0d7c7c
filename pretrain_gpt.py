"""Pretrain a GPT model. Launch with torchrun (or srun under Slurm):

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --data-path examples/data/bible_text_document --tokenizer-model examples/data/bible.model ...

Flags follow Megatron-LM's names; `python pretrain_gpt.py --help` lists them all.
"""

import sys

from megatron_po.training import run_main

if __name__ == "__main__":
    sys.exit(run_main(sys.argv[1:], description="Pretrain a GPT model (megatron_po)"))
