"""Where the experts are: which layers are MoE layers (--moe-layer-freq), an expert's MLP size, and which
experts an expert-parallel rank holds.

--moe-layer-freq takes Megatron's two forms: an integer N (layer i is an MoE layer when i % N == 0, the first
layer included) or a list with one 0/1 per layer written as Megatron's scripts write it, `([0]*1+[1]*3)`.
Megatron evaluates that string with Python's `eval`; here it is read by a parser that knows list literals of
integers, `*` by an integer, `+` of lists and parentheses, and nothing else.
"""

from __future__ import annotations

import ast

from megatron_po.config import ModelConfig, ffn_hidden_size
from megatron_po.errors import ConfigError

_FREQ_HELP = "an integer N (every N-th layer, from the first) or a list of 0/1 per layer such as ([0]*1+[1]*3)"


def _evaluate(node: ast.AST):
    """An integer or a list of integers, from the few node kinds --moe-layer-freq's list form uses."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_evaluate(e) for e in node.elts]
        if not all(isinstance(i, int) for i in items):
            raise ValueError("a list holds integers only")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) == isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            lst, n = (left, right) if isinstance(left, list) else (right, left)
            if n < 0 or n > 1_000_000:
                raise ValueError("a repeat count must be in [0, 1e6]")
            return lst * n
    raise ValueError(f"unsupported expression {ast.dump(node)[:40]}")


def parse_layer_freq(text: str, num_layers: int) -> list[bool]:
    """--moe-layer-freq as one flag per layer (True: MoE layer). ConfigError (one line) on anything else."""
    try:
        value = _evaluate(ast.parse(str(text).strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError) as e:
        raise ConfigError(f"--moe-layer-freq {text!r} is not {_FREQ_HELP} ({e})") from None
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"--moe-layer-freq {value} must be >= 1 (or {_FREQ_HELP})")
        return [i % value == 0 for i in range(num_layers)]
    if len(value) != num_layers or any(v not in (0, 1) for v in value):
        raise ConfigError(f"--moe-layer-freq {text!r} must list one 0 or 1 per layer: {len(value)} entries for "
                          f"--num-layers {num_layers}")
    return [v == 1 for v in value]


def uses_moe(m: ModelConfig) -> bool:
    return m.num_experts is not None


def moe_layer_pattern(m: ModelConfig) -> list[bool]:
    """One flag per layer of the model (global layer numbers): True where the MLP is a mixture of experts."""
    if not uses_moe(m):
        return [False] * m.num_layers
    return parse_layer_freq(m.moe_layer_freq, m.num_layers)


def moe_layer_numbers(m: ModelConfig) -> list[int]:
    """The global numbers of the MoE layers: the decoder's (`moe_layer_pattern`), then the MTP depths' layers
    (L .. L + --mtp-num-layers - 1, models/mtp.py) where the last decoder layer is an MoE layer."""
    pattern = moe_layer_pattern(m)
    mtp = range(m.num_layers, m.num_layers + (m.mtp_num_layers or 0)) if pattern and pattern[-1] else []
    return [i for i, moe in enumerate(pattern) if moe] + list(mtp)


def expert_ffn_hidden_size(m: ModelConfig) -> int:
    """One expert's MLP hidden size: --moe-ffn-hidden-size, else --ffn-hidden-size (Megatron's default)."""
    return m.moe_ffn_hidden_size if m.moe_ffn_hidden_size is not None else ffn_hidden_size(m)


def local_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The experts expert-parallel rank `ep_rank` holds: a contiguous block of num_experts / ep_size."""
    n = num_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)
