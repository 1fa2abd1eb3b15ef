"""Structured output: grammars from `SamplingParams.structured_output`, enforced in the engine
while decoding (see backend.py)."""

from axon.structured.backend import StructuredOutputs, check_grammar, unpack_bitmask
from axon.structured.grammars import build_grammar

__all__ = ["StructuredOutputs", "build_grammar", "check_grammar", "unpack_bitmask"]
