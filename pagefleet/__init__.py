"""pagefleet: a KV-cache-aware LLM serving cluster.

Imports are lazy so that `pagefleet plan` and `pagefleet --help` start without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "Client", "AsyncClient"]

_LAZY = {
    "LLM": ("pagefleet.llm", "LLM"),
    "SamplingParams": ("worker.sampling_params", "SamplingParams"),
    "StructuredOutputs": ("worker.structured_outputs", "StructuredOutputs"),
    "RequestOutput": ("worker.outputs", "RequestOutput"),
    "Client": ("pagefleet.client", "Client"),
    "AsyncClient": ("pagefleet.client", "AsyncClient"),
}

if TYPE_CHECKING:
    from pagefleet.client import AsyncClient, Client
    from pagefleet.llm import LLM
    from worker.outputs import RequestOutput
    from worker.sampling_params import SamplingParams
    from worker.structured_outputs import StructuredOutputs


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'pagefleet' has no attribute {name!r}")
