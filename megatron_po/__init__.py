"""megatron_po: Megatron-style LLM pretraining with asynchronous PipeOptim pipelines."""

__version__ = "0.1.0"
