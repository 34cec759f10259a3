"""The model the steps run: its configuration, its weights (safetensors or GGUF, the built-in
random model), its tensor-parallel layers and its architectures."""
