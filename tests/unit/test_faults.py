"""Fault classification: a failed collective or a CUDA error poisons the model, whatever its
text says; a shape mistake or one of our own value checks fails only the step. The benign
errors are real torch errors, raised by calling torch with mismatched shapes; the gloo failure
is a real collective failing in-process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from axon.engine.faults import InjectedDeviceFault, is_device_fault


def _raised(call) -> BaseException:
    with pytest.raises(BaseException) as info:
        call()
    return info.value


@pytest.mark.parametrize(
    "call",
    [
        lambda: torch.ones(3) + torch.ones(4),  # "must match the size of tensor b"
        lambda: torch.broadcast_shapes((2,), (3,)),  # "Attempting to broadcast a dimension"
        lambda: torch.ones(2, 3).expand(4, 3),  # "must match the existing size"
        lambda: torch.ones(2, 3) @ torch.ones(4, 5),  # "shapes cannot be multiplied"
        lambda: torch.ones(2, 3).view(4, 5),  # "is invalid for input of size"
        lambda: torch.cat([torch.ones(2, 3), torch.ones(2, 4)]),  # "Sizes of tensors must match"
        lambda: torch.ones(3)[5],  # IndexError
    ],
)
def test_real_torch_shape_errors_are_benign(call):
    exc = _raised(call)
    assert not is_device_fault(exc), f"{type(exc).__name__}: {exc}"


def test_a_shape_error_wrapped_by_our_code_is_benign():
    try:
        try:
            torch.broadcast_tensors(torch.ones(2), torch.ones(3))
        except RuntimeError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert not is_device_fault(outer)  # the cause chain is read


def test_a_real_gloo_broadcast_failure_poisons():
    # A real collective that fails inside gloo; its message says "broadcast", which alone used
    # to pass for a benign broadcasting mistake.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        exc = _raised(lambda: dist.broadcast(torch.ones(3), src=1))
    finally:
        dist.destroy_process_group()
    assert "broadcast" in str(exc).lower()
    assert is_device_fault(exc)
    try:
        raise RuntimeError("step failed") from exc
    except RuntimeError as outer:
        assert is_device_fault(outer)


def test_any_exception_raised_from_a_collective_poisons():
    # A plain ValueError, but torch.distributed raised it: the collective did not happen.
    exc = _raised(lambda: dist.all_reduce(torch.ones(3)))
    assert isinstance(exc, ValueError)
    assert is_device_fault(exc)


@pytest.mark.parametrize(
    "exc",
    [
        dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, ncclBroadcast failed"),
        dist.DistError("watchdog caught collective operation timeout: WorkNCCL(OpType=BROADCAST)"),
        RuntimeError("NCCL communicator was aborted on rank 1 during broadcast"),
        RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer (broadcast)"),
        RuntimeError("CUDA error: device-side assert triggered"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        InjectedDeviceFault(),
    ],
    ids=["dist-backend", "dist-timeout", "nccl-text", "gloo-text", "cuda", "oom", "injected"],
)
def test_collective_and_cuda_errors_poison(exc):
    assert is_device_fault(exc)


def test_a_benign_error_raised_while_handling_a_device_fault_poisons():
    try:
        try:
            raise dist.DistBackendError("NCCL error: unhandled system error")
        except RuntimeError:
            raise ValueError("could not sample")  # noqa: B904 - the implicit context is the point
    except ValueError as exc:
        assert is_device_fault(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("prompt too long"),
        ValueError("tensor_parallel needs an nccl process group"),  # our own check, by type
        KeyError("request-3"),
        RuntimeError("logits unhealthy: nan in row 2"),
        RuntimeError("scheduler stalled"),
    ],
)
def test_our_own_errors_are_benign(exc):
    assert not is_device_fault(exc)


@pytest.mark.parametrize(
    "exc", [RuntimeError("something odd"), AttributeError("'NoneType' object has no attribute")]
)
def test_unknown_errors_poison(exc):
    assert is_device_fault(exc)
