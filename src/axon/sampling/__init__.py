"""Batched token sampling: `Sampler()(logits, SamplingMetadata.from_sequences(...))`."""

from axon.sampling.metadata import SamplingMetadata
from axon.sampling.sampler import Sampler, SamplerOutput, TokenLogprobs

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "TokenLogprobs"]
