"""Which engine errors are device faults (poison the model) and which fail one batch only.

A device fault leaves the device (or a process group) in an unknown state, so the engine stops
touching it (drain-only) and the model is recovered in a fresh process. The exception chain is
classified by what it is and where it came from before anything reads its text:

1. poison: a torch.distributed error, anything raised from inside torch.distributed or
   torch.cuda (a failed collective leaves the other ranks waiting, whatever the exception type),
   a CUDA / accelerator error or an out-of-memory error, and any other error (not one of the
   plain types below) whose message names NCCL, gloo, a process group or a CUDA failure;
2. benign: Python's plain ValueError / TypeError / KeyError / IndexError (our own checks);
3. otherwise (a RuntimeError or other error of unknown origin) benign only when its text names a
   known benign cause by a specific phrase (a shape mismatch, a tokenizer error, an empty
   prompt, unhealthy logits), else poison. Never the bare word "broadcast": NCCL's broadcast
   fails with it too.
"""

from __future__ import annotations

import sys
import traceback

# The places a collective or a device call raises from (path pieces, "/"-separated).
_DEVICE_ORIGINS = ("/torch/distributed/", "/torch/cuda/")
# torch exception types that always poison, looked up by name so this module needs no torch.
_DEVICE_TYPES = (
    ("torch.distributed", "DistError"),  # DistBackendError, DistNetworkError, DistStoreError
    ("torch", "OutOfMemoryError"),
    ("torch", "AcceleratorError"),
    ("torch.cuda", "CudaError"),
)
_DEVICE_MARKERS = (
    "nccl",
    "gloo",
    "processgroup",
    "process group",
    "collective operation",
    "cuda error",
    "cudnn_status",
    "cublas_status",
    "device-side assert",
    "illegal memory access",
    "out of memory",
)
_BENIGN_MARKERS = (
    "shape mismatch",
    "shapes cannot be broadcast",
    "cannot be broadcast",
    "attempting to broadcast a dimension",
    "must match the size",
    "must match the existing size",
    "cannot be multiplied",
    "is invalid for input of size",
    "sizes of tensors must match",
    "logits unhealthy",
    "tokenize",
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


def _device_types() -> tuple[type, ...]:
    """The poisoning torch exception types of the torch modules loaded (none loaded: none can
    have been raised)."""
    found = []
    for module_name, name in _DEVICE_TYPES:
        cls = getattr(sys.modules.get(module_name), name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def _raised_from_device_code(exc: BaseException) -> bool:
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        path = frame.f_code.co_filename.replace("\\", "/")
        if any(origin in path for origin in _DEVICE_ORIGINS):
            return True
    return False


def _is_device_error(exc: BaseException, device_types: tuple[type, ...]) -> bool:
    """By type or origin; by text only for an error that is not one of our own plain checks
    (a ValueError naming "nccl" in a config message is no failed collective)."""
    if isinstance(exc, (InjectedDeviceFault, *device_types)) or _raised_from_device_code(exc):
        return True
    if isinstance(exc, _BENIGN_TYPES):
        return False
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(marker in text for marker in _DEVICE_MARKERS)


def is_device_fault(exc: BaseException) -> bool:
    """True when `exc` must poison the model rather than fail only the current step."""
    chain = _chain(exc)
    device_types = _device_types()
    if any(_is_device_error(link, device_types) for link in chain):
        return True
    if isinstance(exc, _BENIGN_TYPES):
        return False
    text = " | ".join(f"{type(link).__name__}: {link}" for link in chain).lower()
    return not any(marker in text for marker in _BENIGN_MARKERS)


class InjectedDeviceFault(RuntimeError):
    """Raised by the engine's fault-injection test hook; reads like a CUDA fault."""

    def __init__(self) -> None:
        super().__init__("CUDA error: an illegal memory access was encountered (injected)")
