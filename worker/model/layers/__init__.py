"""Tensor-parallel-ready building blocks of the Llama family (Megatron-named)."""
