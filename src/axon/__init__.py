"""axon: a self-hosted LLM inference engine on PyTorch."""

from __future__ import annotations

import importlib

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

# Imported on first use, so `axon --help` and the HTTP frontend's light paths skip torch.
_EXPORTS = {
    "LLM": "axon.engine.llm",
    "SamplingParams": "axon.sampling_params",
    "RequestOutput": "axon.outputs",
    "CompletionOutput": "axon.outputs",
    "Logprob": "axon.outputs",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'axon' has no attribute {name!r}")
