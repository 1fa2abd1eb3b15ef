"""axon: a self-hosted LLM inference engine on PyTorch."""

from axon.engine.llm import LLM
from axon.outputs import CompletionOutput, Logprob, RequestOutput
from axon.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
