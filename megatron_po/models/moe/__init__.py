"""Mixture of Experts (Megatron-core's MoE, its flags and semantics): the MoE layer reads router -> dispatch ->
experts -> combine (layer.py), one concept per module: which layers and experts (layout.py), the router and the
expert bias (router.py), the auxiliary losses (aux_losses.py), the token dispatchers (dispatcher.py), the experts
(experts.py), the config rules (rules.py). The expert-parallel process groups live in parallel_state.py."""
