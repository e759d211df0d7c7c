"""The multi-latent attention config rules (rows of config_rules.RULES, tests/test_config_rules.py).

Megatron's own checks (MLA excludes grouped-query attention; --rope-type yarn only under MLA), the sizes, the
flags that mean something only under MLA, and what this code's MLA does not take (the plain attention's RoPE
options, Transformer Engine's layers, the NMT workload). A head count TP does not divide is the layout's rule
heads-vs-tp, as for any attention.
"""

from __future__ import annotations

import math

from megatron_po.config_check import Ctx, Rule, at_least, each
from megatron_po.models.mla import YARN_BETA_FAST, YARN_BETA_SLOW, mla_sizes


def _mla(c: Ctx) -> bool:
    return c.m.multi_latent_attention


# Flags that mean something only with --multi-latent-attention (given, not at their defaults).
_NEED_MLA = [
    ("--q-lora-rank", lambda c: c.m.q_lora_rank is not None),
    ("--kv-lora-rank", lambda c: c.m.kv_lora_rank is not None),
    ("--qk-head-dim", lambda c: c.m.qk_head_dim is not None),
    ("--qk-pos-emb-head-dim", lambda c: c.m.qk_pos_emb_head_dim is not None),
    ("--v-head-dim", lambda c: c.m.v_head_dim is not None),
    ("--rotary-scaling-factor", lambda c: c.m.rotary_scaling_factor != 1.0),
    ("--mscale", lambda c: c.m.mscale != 1.0),
    ("--mscale-all-dim", lambda c: c.m.mscale_all_dim != 0.0),
    ("--yarn-original-max-position-embeddings", lambda c: c.m.yarn_original_max_position_embeddings is not None),
    ("--yarn-beta-fast", lambda c: c.m.yarn_beta_fast is not None),
    ("--yarn-beta-slow", lambda c: c.m.yarn_beta_slow is not None),
    ("--no-yarn-correction-range-round-to-int", lambda c: not c.m.yarn_correction_range_round_to_int),
    ("--mla-down-proj-fusion", lambda c: c.m.mla_down_proj_fusion),
    ("--mla-latent-norm-epsilon", lambda c: c.m.mla_latent_norm_epsilon is not None),
]

# The plain attention's RoPE options, which MLA's RoPE (--rope-type) does not read.
_PLAIN_ROPE = [
    ("--use-rope-scaling", lambda c: c.m.use_rope_scaling),
    ("--rotary-seq-len-interpolation-factor", lambda c: c.m.rotary_seq_len_interpolation_factor is not None),
    ("--rotary-percent", lambda c: c.m.rotary_percent != 1.0),
]


def _yarn_betas(c: Ctx) -> tuple[float, float]:
    return c.m.yarn_beta_fast or YARN_BETA_FAST, c.m.yarn_beta_slow or YARN_BETA_SLOW


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


MLA_RULES = [
    *at_least(1, [("--q-lora-rank", lambda c: c.m.q_lora_rank), ("--kv-lora-rank", lambda c: c.m.kv_lora_rank),
                  ("--qk-head-dim", lambda c: c.m.qk_head_dim),
                  ("--qk-pos-emb-head-dim", lambda c: c.m.qk_pos_emb_head_dim),
                  ("--v-head-dim", lambda c: c.m.v_head_dim),
                  ("--yarn-original-max-position-embeddings", lambda c: c.m.yarn_original_max_position_embeddings)],
              optional=True),
    *each("{flag}-needs-mla", _NEED_MLA, lambda c, flag: f"{flag} applies to multi-latent attention: add "
                                                         f"--multi-latent-attention", when=lambda c: not _mla(c)),
    Rule("rope-type-yarn-needs-mla", lambda c: c.m.rope_type != "yarn",
         "--rope-type yarn is multi-latent attention's RoPE (as in Megatron, where plain attention takes only rope): "
         "add --multi-latent-attention", when=lambda c: not _mla(c)),
    Rule("mla-vs-group-query-attention", lambda c: not c.m.group_query_attention,
         "--group-query-attention with --multi-latent-attention: every MLA head has its own keys and values, "
         "up-projected from one shared latent (Megatron excludes the two as well); drop --group-query-attention",
         when=_mla),
    Rule("mla-rope-even", lambda c: mla_sizes(c.m).qk_pos_emb_head_dim % 2 == 0,
         lambda c: f"--qk-pos-emb-head-dim ({mla_sizes(c.m).qk_pos_emb_head_dim}) must be even: RoPE rotates its "
                   f"dimensions in pairs", when=_mla),
    *each("{flag}-vs-mla", _PLAIN_ROPE,
          lambda c, flag: f"{flag} configures the plain attention's RoPE; multi-latent attention's is --rope-type "
                          f"(yarn: --rotary-scaling-factor, --mscale, --mscale-all-dim): drop {flag}", when=_mla),
    Rule("mla-yarn-settings",
         lambda c: (c.m.rotary_scaling_factor > 0 and _finite(c.m.rotary_scaling_factor, c.m.mscale, c.m.mscale_all_dim)
                    and 0 < _yarn_betas(c)[1] < _yarn_betas(c)[0] < math.inf),
         lambda c: f"YaRN needs a finite --rotary-scaling-factor > 0 (got {c.m.rotary_scaling_factor}), finite "
                   f"--mscale and --mscale-all-dim (got {c.m.mscale}, {c.m.mscale_all_dim}) and 0 < --yarn-beta-slow "
                   f"< --yarn-beta-fast (got {_yarn_betas(c)[1]}, {_yarn_betas(c)[0]})", when=_mla),
    Rule("mla-local-layers", lambda c: c.m.transformer_impl == "local",
         "--multi-latent-attention runs in the local layers here; the Transformer Engine layers take no MLA: use "
         "--transformer-impl local", when=_mla),
    Rule("cache-mla-latents-refused", lambda c: not c.m.cache_mla_latents,
         "--cache-mla-latents is the latent KV cache of Megatron's inference engine (it conflicts with training "
         "there): drop it"),
    Rule("mla-gpt-only", lambda c: c.workload == "gpt",
         "--multi-latent-attention applies to pretrain_gpt.py: the NMT model's attention is multi-head", when=_mla),
]
