"""Hugging Face `transformers` checkpoints <-> ours, as data: families.py (the families served: class, tensor
table, config keys), tensors.py (the rules and the transforms they name), configs.py (config.json <-> our
ModelConfig, and which family holds a model), files.py (safetensors read and written one tensor at a time).
The streamed conversions that use them: megatron_po/distributed/checkpoint_hf.py."""
