"""Tensor parallelism around the model runner, rank 0's side: the checks made before any rank
starts, the start of ranks 1..N-1, the per-rank KV plan agreement and each step's fan-out.

Rank 0 (the engine process) schedules and samples; every step it sends the compact step input
(token ids, positions, slot mapping, key slots: no activations) to the other ranks, which run
the same forward, meet rank 0 in the all-reduces, and wait on their pipe between steps (their
loop is rank_main's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import pickle

import torch

from axon.config import EngineConfig
from axon.distributed import multinode
from axon.distributed.parallel_state import (
    control_group,
    destroy_tp_group,
    init_tp_group,
    single_rank,
    tp_all_reduce_min,
)
from axon.distributed.workers import RankFailed, TPWorkers, move_tensors
from axon.kernels import ggml_q8
from axon.loader import is_gguf, iterate_weights
from axon.loader.gguf import iterate_gguf_file, open_gguf, tp_split_problem
from axon.loader.safetensors import iterate_safetensors
from axon.runner.memory import KVCachePlan

logger = logging.getLogger(__name__)
_IMAGE_KEYS = itertools.count()  # rank 0's name for a request's images on the other ranks
# What ranks 1..N-1 run, imported by name in their own program (an import here would close a
# cycle: rank_main builds a ModelRunner, whose module imports this one).
RANK_TARGET = "axon.runner.rank_main:worker_main"

# The architectures whose every layer shards (column / row / QKV / merged linears,
# vocab-parallel embedding and LM head; Gated DeltaNet by key/value head groups).
TP_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "qwen3_5_text",
    "qwen3_5",
    "qwen3_vl",  # its DeepStack rows are sliced like the image rows on every rank
    # Every expert cut along its intermediate dimension, the router replicated.
    "qwen3_moe",
    "qwen3_5_moe_text",
    "qwen3_5_moe",
)
# Head counts and widths that must divide by the number of ranks, where the config has them.
_DIVIDED = (
    "num_attention_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


def check_tp_support(config: EngineConfig, hf_config) -> None:
    """Raises ValueError, naming the value, unless `config.tensor_parallel_size` ranks can
    shard this checkpoint: a sharded architecture whose heads and intermediate size divide
    evenly (KV heads divide, or are replicated evenly); a GGUF file's row-parallel tensors
    split on whole quant blocks."""
    size = config.tensor_parallel_size
    if size == 1:
        return
    problem = tp_split_problem(config.model, size) if is_gguf(config.model) else None
    if problem:
        raise ValueError(problem)
    model_type = hf_config.model_type
    if model_type not in TP_MODEL_TYPES:
        raise ValueError(
            f"tensor_parallel_size {size}: model_type {model_type!r} is not sharded yet "
            f"(tensor-parallel architectures: {', '.join(TP_MODEL_TYPES)})"
        )
    text = hf_config.get_text_config()
    for name in _DIVIDED:
        value = getattr(text, name, None)
        if value is not None and value % size:
            raise ValueError(f"{name} {value} is not divisible by tensor_parallel_size {size}")
    kv_heads = text.num_key_value_heads
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"num_key_value_heads {kv_heads} is neither divisible by nor a divisor of "
            f"tensor_parallel_size {size}"
        )
    local = multinode.ranks_per_node(config)
    if config.torch_device().type == "cuda" and torch.cuda.device_count() < local:
        raise ValueError(
            f"tensor_parallel_size {size} needs {local} GPUs per node, this engine sees "
            f"{torch.cuda.device_count()}"
        )


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """This rank's device: the configured one, or with CUDA and several ranks, cuda:i for the
    node's i-th rank (of the devices the engine sees)."""
    device = config.torch_device()
    if device.type == "cuda" and config.tensor_parallel_size > 1:
        device = torch.device("cuda", rank % multinode.ranks_per_node(config))
        torch.cuda.set_device(device)
    return device


def model_scope(config: EngineConfig):
    """Where a model is built: as one rank when the config has one rank (the process may hold
    another engine's group), else in the group this process joined."""
    return single_rank() if config.tensor_parallel_size == 1 else contextlib.nullcontext()


def checkpoint_weights(config: EngineConfig):
    """(name, tensor) pairs of the checkpoint; with several ranks, lazy slices of the mmapped
    safetensors, or GGUF blocks as views of the mapped file, that each rank reads only its
    shard of."""
    if config.tensor_parallel_size == 1:
        spec = getattr(config, "speculative_config", None)
        return iterate_weights(config.model, with_mtp=spec is not None and spec.method == "mtp")
    if is_gguf(config.model):
        return iterate_gguf_file(config.model, mapped=True)
    return iterate_safetensors(config.model, sliced=True)


def start_ranks(config: EngineConfig, hf_config, device: torch.device) -> TPWorkers | None:
    """On rank 0: check the model shards, start this node's ranks 1..L-1 and join the group
    with them (and with the other nodes' ranks, which get this config). None with one rank
    (nothing started, no group: the single-rank path pays nothing)."""
    check_tp_support(config, hf_config)
    if config.tensor_parallel_size == 1:
        return None
    if config.node_rank != 0:
        raise ValueError(
            f"node_rank {config.node_rank} holds no engine: run it with `axon serve --headless`"
        )
    if torch.distributed.is_initialized():
        raise ValueError(
            "this process already holds a tensor-parallel group (another engine's): run one "
            "tensor-parallel engine per process (the server gives each model its own)"
        )
    timeout = config.tp_step_timeout_s
    level = logging.getLogger().getEffectiveLevel()
    config = ranks_config(config)
    args = (config, torch.get_num_threads(), level, timeout)
    local, rendezvous = multinode.ranks_per_node(config), multinode.rendezvous(config)
    workers = TPWorkers.spawn(local, RANK_TARGET, args, timeout, rendezvous)
    try:
        workers.expect("joining")  # a rank that cannot start fails here, not in the rendezvous
        reduce_bytes = (  # the largest all-reduce: [max batched tokens, hidden] activations
            hf_config.get_text_config().hidden_size
            * config.max_num_batched_tokens
            * config.torch_dtype(hf_config).itemsize
        )
        size, control = config.tensor_parallel_size, multinode.control_ranks(config)
        init_tp_group(
            workers.store_path, 0, size, device, timeout, reduce_bytes, control, config.tp_allreduce
        )
        if control is not None:  # the other nodes' ranks load what this engine loads
            workers.control = control_group()
            multinode.send_bytes(pickle.dumps(config), workers.control, timeout)
    except BaseException:
        workers.close(0.0)
        raise
    return workers


def ranks_config(config: EngineConfig) -> EngineConfig:
    """The engine arguments the other ranks load with: rank 0's, with `auto` activations
    replaced by rank 0's decision. A rank that resolved `auto` itself could decide otherwise
    (another node's CPU without the 8-bit SIMD path) and run its shard in another precision,
    with another KV cache dtype, than rank 0's."""
    if config.activation_precision != "auto":
        return config
    return dataclasses.replace(config, activation_precision=auto_activation_precision(config))


def auto_activation_precision(config: EngineConfig) -> str:
    """What `auto` means for this checkpoint on this process's device and CPU, read from the
    file before any weight loads: the rule of layers/int8_activations.set_activation_precision
    (int8 for quantized GGUF weights that an 8-bit kernel multiplies, on the CPU, where the
    kernels have their SIMD path; float32 otherwise). An untied input embedding does not count:
    a step gathers its rows, it multiplies nothing."""
    if not is_gguf(config.model) or config.torch_device().type != "cpu" or not ggml_q8.simd():
        return "float32"
    tensors = open_gguf(str(config.model)).tensors
    untied = any(tensor.name == "output.weight" for tensor in tensors)
    for tensor in tensors:
        if untied and tensor.name == "token_embd.weight":
            continue
        if len(tensor.shape) >= 2 and ggml_q8.supports([tensor.tensor_type]):
            return "int8"
    return "float32"


def stop_ranks(workers: TPWorkers | None) -> None:
    """Rank 0's shutdown of the other ranks and of the group (nothing with one rank)."""
    if workers is not None:
        workers.close()
        destroy_tp_group()


def agree_on_plan(plan: KVCachePlan) -> KVCachePlan:
    """The plan every rank can hold: the fewest KV blocks of any rank (block ids are rank 0's
    and index every rank's cache alike)."""
    (num_blocks,) = tp_all_reduce_min([plan.num_blocks])
    if num_blocks == plan.num_blocks:
        return plan
    max_model_len = min(plan.max_model_len, num_blocks * plan.block_size)
    return dataclasses.replace(plan, num_blocks=num_blocks, max_model_len=max_model_len)


def step_input(batch, device: torch.device, images_sent: set[int]):
    """What the other ranks need of a StepBatch, on the CPU: all of it but the sequences and,
    in place of the tower's output, the pixels it came from (see `image_sources`)."""
    changes: dict = {"sampling_seqs": []}
    if batch.image_takes:
        sources = image_sources(batch.image_takes, images_sent)
        changes.update(image_values=None, image_deepstack=None, image_takes=sources)
    batch = dataclasses.replace(batch, **changes)
    return batch if device.type == "cpu" else move_tensors(batch, torch.device("cpu"))


def image_sources(takes: list, images_sent: set[int]) -> list[tuple]:
    """(key, (pixel_values, grid_thw) or None, first row, end row, last) per taken part of a
    request's tower output. The pixels travel once per request (None once the ranks hold its
    output under `key`, tracked in `images_sent`); `last` marks the part that ends its images,
    after which the ranks drop that output (and a recompute after preemption resends)."""
    sources, done = [], []
    for images, taken in takes:
        key = getattr(images, "tp_key", None)
        if key is None:
            key = images.tp_key = next(_IMAGE_KEYS)
        pixels = None if key in images_sent else (images.pixel_values, images.grid_thw)
        images_sent.add(key)
        last = taken.stop == sum(count for _, count in images.spans)
        sources.append((key, pixels, taken.start, taken.stop, last))
        if last:
            done.append(key)
    images_sent.difference_update(done)
    return sources


def run_step(runner, batch) -> torch.Tensor:
    """Rank 0's step: fan the input out, run its own forward, drain every rank's reply. A
    failure on rank 0 mid-forward leaves the other ranks inside a collective: the error says
    the group is out of step (a device fault: the model is recovered in fresh processes)."""
    workers = runner.workers
    workers.send_step(step_input(batch, runner.device, workers.images_sent))
    try:
        logits = runner.run_forward(batch)
    except Exception as exc:
        raise RankFailed(
            f"tensor-parallel step failed on rank 0, the process group is out of step: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    runner.workers.collect()
    return logits
