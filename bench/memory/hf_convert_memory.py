import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import bench_common  # noqa: E402  (puts the bench family folders and the repo on sys.path)
bench_common.add_repo_to_path()

__doc__ = """Peak host memory of the streamed Hugging Face conversions (issue 56): import-hf and export-hf of a Llama of
over 1 GB on disk, against the largest tensor and the largest layer.

    python bench/memory/hf_convert_memory.py [--layers 10] [--hidden 2048] [--dir DIR] [--quick]

A LlamaForCausalLM directory (bf16, random weights, GQA 16 heads / 4 groups, ffn 5632, vocabulary 32,000, untied
head; sharded at 500 MB with model.safetensors.index.json) is generated tensor by tensor under --dir (default: a
temporary directory), then each conversion runs in its own process (`tools/checkpoint_convert.py`), whose peak
resident set (VmHWM) is read at its end: import-hf (the HF directory -> our checkpoint), export-hf (that
checkpoint -> HF shards of 500 MB). The same two commands on a 2-layer model of hidden 64 (vocabulary 1,024) give
each tool's fixed cost (interpreter, torch, transformers, DCP: the baseline); the streamed part of the peak is the
difference, compared with the largest tensor and the largest layer. Everything generated is deleted at the end.
Writes bench/results/hf_convert_memory.md (`--quick`: a small model, printed only).
"""

import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

RESULTS = os.path.join(bench_common.RESULTS, "hf_convert_memory.md")
# VmHWM, the peak of this process's own memory: ru_maxrss would keep the forking parent's across the exec.
MEASURE = ("import sys; from tools.checkpoint_convert import main; code = main(sys.argv[1:]); "
           "print('PEAK_KB', next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM'))); "
           "sys.exit(code)")


def generate(directory: str, layers: int, hidden: int, vocab: int = 32000) -> dict:
    """A random bf16 Llama under `directory`, written one tensor at a time; its sizes."""
    import torch
    import transformers

    from megatron_po.models.hf.files import ShardedWriter, nbytes
    heads, groups, head_dim, ffn = 16, 4, hidden // 16, hidden * 11 // 4
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=groups,
                                      head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=False,
                                      bos_token_id=None, eos_token_id=None, architectures=["LlamaForCausalLM"])
    config.dtype = torch.bfloat16
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    layer = [("input_layernorm.weight", (hidden,)), ("self_attn.q_proj.weight", (heads * head_dim, hidden)),
             ("self_attn.k_proj.weight", (groups * head_dim, hidden)),
             ("self_attn.v_proj.weight", (groups * head_dim, hidden)),
             ("self_attn.o_proj.weight", (hidden, heads * head_dim)), ("post_attention_layernorm.weight", (hidden,)),
             ("mlp.gate_proj.weight", (ffn, hidden)), ("mlp.up_proj.weight", (ffn, hidden)),
             ("mlp.down_proj.weight", (hidden, ffn))]
    plan = [("model.embed_tokens.weight", (vocab, hidden))]
    plan += [(f"model.layers.{i}.{n}", s) for i in range(layers) for n, s in layer]
    plan += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    plan = [(n, s, torch.bfloat16) for n, s in plan]
    writer = ShardedWriter(directory, plan, 500 * 10**6)
    g = torch.Generator().manual_seed(0)
    for name, shape, dtype in plan:
        t = torch.randn(shape, generator=g).mul_(0.02).to(dtype)
        writer.write(name, t.add_(1) if name.endswith("norm.weight") else t)
    writer.close()
    return {"disk": sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)),
            "largest_tensor": max(nbytes(s, d) for _, s, d in plan),
            "layer": sum(nbytes(s, torch.bfloat16) for _, s in layer), "files": len(writer.files)}


def peak_kb(argv: list[str]) -> tuple[int, float]:
    """(peak resident KB, seconds) of `tools/checkpoint_convert.py argv` in its own process."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", MEASURE, *argv], cwd=bench_common.REPO, capture_output=True,
                         text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode:
        raise SystemExit(f"{argv[0]} failed:\n{out.stderr[-2000:]}")
    line = next(line for line in out.stdout.splitlines() if line.startswith("PEAK_KB"))
    return int(line.split()[1]), time.perf_counter() - started


def convert(root: str, model: str) -> dict:
    """Peak KB and seconds of import-hf and export-hf of the HF directory `root/model`."""
    hf, ckpt, back = (os.path.join(root, f"{model}{suffix}") for suffix in ("", "_ckpt", "_back"))
    imp = peak_kb(["import-hf", "--hf", hf, "--out", ckpt, "--no-progress"])
    exp = peak_kb(["export-hf", "--load", ckpt, "--out", back, "--max-shard-size", "500MB", "--no-progress"])
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(ckpt) for f in files)
    return {"import": imp, "export": exp, "ckpt_bytes": size,
            "back_files": len([f for f in os.listdir(back) if f.endswith(".safetensors")])}


def main(argv=None) -> None:
    parser = bench_common.parser(__doc__)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dir", default=None, help="where to generate (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="2 layers of hidden 512 (printed only)")
    args = parser.parse_args(argv)
    layers, hidden = (2, 512) if args.quick else (args.layers, args.hidden)
    opening = bench_common.card(__file__, argv, "Peak host memory of the streamed HF import and export",
                                "CPU", f"Llama, {layers} layers, hidden {hidden}, bf16, vocabulary 32,000")
    lines = bench_common.Lines(opening)
    root = tempfile.mkdtemp(prefix="hf-memory-", dir=args.dir)
    try:
        small = generate(os.path.join(root, "small"), 2, 64, vocab=1024)
        base = convert(root, "small")
        big = generate(os.path.join(root, "big"), layers, hidden)
        run = convert(root, "big")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    lines.emit(f"Model: {mb(big['disk'])} on disk in {big['files']} safetensors shards; largest tensor "
               f"{mb(big['largest_tensor'])} (embedding, lm_head), one layer {mb(big['layer'])}; our checkpoint "
               f"{mb(run['ckpt_bytes'])}; exported into {run['back_files']} shards. Baseline: the same tools on a "
               f"2-layer hidden-64 model ({small['disk'] / 2**10:,.0f} KiB).")
    lines.emit("")
    lines.emit("| conversion | peak RSS | baseline peak | streamed part (peak - baseline) | largest tensor + one layer "
               "| time |")
    lines.emit("|---|---|---|---|---|---|")
    for kind in ("import", "export"):
        peak, seconds = run[kind]
        extra = peak * 1024 - base[kind][0] * 1024
        lines.emit(f"| {kind}-hf | {mb(peak * 1024)} | {mb(base[kind][0] * 1024)} | {mb(extra)} | "
                   f"{mb(big['largest_tensor'] + big['layer'])} | {seconds:.0f} s |")
    lines.emit("")
    lines.emit(bench_common.load_at_start().replace("at start", "at end"))
    if not args.quick:
        bench_common.write_text(RESULTS, "\n".join(lines.lines) + "\n")


if __name__ == "__main__":
    main()
