"""Model architectures, by Hugging Face architecture name."""

from worker.model.models.llama import LlamaForCausalLM

# HF architecture name -> our class; Mistral and Qwen2/3 are Llama with a few switches.
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
