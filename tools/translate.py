"""Translate text with a pretrain_nmt.py checkpoint (any TP/PP/DP layout), greedy or beam search.

    python tools/translate.py --load runs/nmt_tiny/checkpoints --input data/bible_en_fr_test.en \
        --reference data/bible_en_fr_test.fr --beam-size 5 --output test.hyp.fr
    echo "In the beginning God created the heavens and the earth." | python tools/translate.py --load CKPT

Runs in one process (the checkpoint's global tensors are read whole, as tools/checkpoint_convert.py
does). Input lines are normalised like tools/preprocess_nmt.py normalises training text, tokenized with
the run's sentencepiece model(s) (override with --tokenizer-model / --tgt-tokenizer-model), decoded in
length-sorted batches (`--beam-size 1` is greedy; `--length-penalty` divides a hypothesis' log-probability
by length**alpha), detokenised and written one line per input line (an empty input line gives an empty
output line). With `--reference` it reports sacrebleu's corpus BLEU and chrF on stderr; `--copy-source`
scores the normalised input itself as the translation (the copy-the-source baseline, no checkpoint).
"""

import os
import sys

if not __package__:  # run as `python tools/translate.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse

from megatron_po.errors import DataError, UserError, run_cli


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", default=None, help="checkpoint directory (pretrain_nmt.py's --save)")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration to load (default: the latest)")
    p.add_argument("--input", default="-", help="source text, one sentence per line ('-': stdin)")
    p.add_argument("--output", default="-", help="where to write the translations ('-': stdout)")
    p.add_argument("--reference", default=None, help="reference translations, line-aligned with --input")
    p.add_argument("--beam-size", type=int, default=1, help="1 = greedy decoding")
    p.add_argument("--length-penalty", type=float, default=1.0, help="alpha in score = log p / length**alpha")
    p.add_argument("--batch-size", type=int, default=32, help="sentences decoded together")
    p.add_argument("--tokenizer-model", default=None, help="source (or joint) sentencepiece model (default: the run's)")
    p.add_argument("--tgt-tokenizer-model", default=None, help="target sentencepiece model (default: the run's)")
    p.add_argument("--copy-source", action="store_true",
                   help="no model: the (normalised) input is the translation; with --reference, the baseline score")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    return run_cli(translate, build_parser().parse_args(argv))


def read_lines(path: str) -> list[str]:
    from tools.preprocess_nmt import normalize
    if path == "-":
        return [normalize(line) for line in sys.stdin]
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    with open(path, encoding="utf-8") as f:
        return [normalize(line) for line in f]


def load_model(args):
    """(model, config, source tokenizer, target tokenizer) from the checkpoint, as one process."""
    import torch

    from megatron_po import parallel_state as ps
    from megatron_po.config import Config, normalize_nmt
    from megatron_po.data.nmt_dataset import load_tokenizer
    from megatron_po.distributed.checkpoint_load import read_full_checkpoint
    from megatron_po.models.nmt import NMTModel

    weights, extra, iteration = read_full_checkpoint(args.load, args.ckpt_step, "model.",
                                                     progress=not args.no_progress)
    saved = extra.get("config") or {}
    if "src_vocab_size" not in extra or "nmt" not in saved:
        raise UserError(f"--load {args.load}: not a translation checkpoint (written by pretrain_nmt.py)")
    cfg = Config()
    for section, values in saved.items():
        for key, value in values.items():
            if hasattr(getattr(cfg, section, None), key):
                setattr(getattr(cfg, section), key, value)
    normalize_nmt(cfg)
    tgt_rows = weights["embedding.word_embeddings.weight"].shape[0]
    src_rows = weights.get("encoder_embedding.word_embeddings.weight", weights["embedding.word_embeddings.weight"]).shape[0]
    model = NMTModel(cfg.model, cfg.nmt, src_rows, tgt_rows, cfg.training.seed)
    for name, p in model.named_parameters():
        if name not in weights or weights[name].shape != p.shape:
            found = tuple(weights[name].shape) if name in weights else "missing"
            raise UserError(f"--load {args.load}: parameter {name} is {found} in the checkpoint, "
                            f"{tuple(p.shape)} in the model built from its config")
        with torch.no_grad():
            p.copy_(weights[name])
    src_tok = load_tokenizer(args.tokenizer_model or cfg.data.tokenizer_model)
    tgt_path = args.tgt_tokenizer_model or cfg.nmt.tgt_tokenizer_model or args.tokenizer_model or cfg.data.tokenizer_model
    tgt_tok = load_tokenizer(tgt_path)
    for side, tok, key in (("source", src_tok, "src_vocab_size"), ("target", tgt_tok, "tgt_vocab_size")):
        if tok.vocab_size != extra[key]:
            raise DataError(f"{side} tokenizer {tok.model_path} has {tok.vocab_size} pieces but the run trained with "
                            f"{extra[key]}: pass the run's model with --{'tgt-' if side == 'target' else ''}tokenizer-model")
    print(f"> loaded {args.load} iteration {iteration}: {cfg.nmt.encoder_num_layers} encoder + "
          f"{cfg.nmt.decoder_num_layers} decoder layers, hidden {cfg.model.hidden_size}", file=sys.stderr)
    return model.to(ps.get_device()).eval(), cfg, src_tok, tgt_tok


def translate(args):
    from megatron_po.errors import ConfigError
    from megatron_po.nmt_workload import corpus_scores
    from megatron_po.pipeline.decode import Stepper, translate_ids

    if args.beam_size < 1 or args.batch_size < 1:
        raise ConfigError("--beam-size and --batch-size must be >= 1")
    if not args.copy_source and args.load is None:
        raise ConfigError("--load is required (or --copy-source for the copy-the-source baseline)")
    sources = read_lines(args.input)
    references = read_lines(args.reference) if args.reference else None
    if references is not None and len(references) != len(sources):
        raise DataError(f"--reference {args.reference} has {len(references)} lines but --input {args.input} has "
                        f"{len(sources)}: they must be line-aligned")
    if args.copy_source:
        outputs = list(sources)
    else:
        model, cfg, src_tok, tgt_tok = load_model(args)
        todo = [i for i, s in enumerate(sources) if s]
        ids = translate_ids(Stepper([model]), [src_tok.tokenize(sources[i]) for i in todo], bos=tgt_tok.bos,
                            eos=tgt_tok.eos, pad=tgt_tok.pad, vocab_size=tgt_tok.vocab_size,
                            max_source_length=cfg.model.seq_length, decoder_seq_length=cfg.nmt.decoder_seq_length,
                            batch_sentences=args.batch_size, beam_size=args.beam_size,
                            length_penalty=args.length_penalty, progress=not args.no_progress)
        outputs = [""] * len(sources)
        for j, i in enumerate(todo):
            outputs[i] = tgt_tok.detokenize(ids[j])
    out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    try:
        for line in outputs:
            out.write(line + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    if references is not None:
        scores = corpus_scores(outputs, references)
        what = "copy-source baseline" if args.copy_source else f"beam {args.beam_size}"
        print(f"BLEU {scores['bleu']:.2f} | chrF {scores['chrf']:.2f} | {len(sources)} sentences, {what}",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
