"""Which engine errors are device faults (poison the model) and which fail one batch only.

neuron's rule, adapted to torch: an error is a device fault unless its rendered chain names a
known benign cause (a shape or broadcast mistake, a tokenizer error, an empty prompt, unhealthy
logits) or it is one of Python's plain value/type errors. A device fault leaves the device in
an unknown state, so the engine stops touching it (drain-only) and the model is recovered in a
fresh process.
"""

from __future__ import annotations

_BENIGN_MARKERS = (
    "shape mismatch",
    "broadcast",
    "cannot broadcast",
    "must match the size",
    "logits unhealthy",
    "tokenize",
    "detokenize",
    "decode_stream",
    "no model for handle",
    "empty prompt",
    "scheduler stalled",
)
_BENIGN_TYPES = (ValueError, TypeError, KeyError, IndexError)


def _chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def is_device_fault(exc: BaseException) -> bool:
    """True when `exc` must poison the model rather than fail only the current step."""
    chain = _chain(exc)
    if isinstance(exc, _BENIGN_TYPES):
        return False
    text = " | ".join(f"{type(e).__name__}: {e}" for e in chain).lower()
    return not any(marker in text for marker in _BENIGN_MARKERS)


class InjectedDeviceFault(RuntimeError):
    """Raised by the engine's fault-injection test hook; reads like a CUDA fault."""

    def __init__(self) -> None:
        super().__init__("CUDA error: an illegal memory access was encountered (injected)")
