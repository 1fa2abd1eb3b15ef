"""The engine settings, each declared once (`TABLE`), and what the entry points make of it.

`axon generate`'s and `axon serve`'s flags come from `add_flags`; the `/models/load` body and the
config file's `[engine]` and `[[default_models]]` tables from server/schemas/node_protocol.py,
which builds its models from `select(ENGINE)` and `select(SPEC)`; the keyword arguments of `LLM` are
EngineConfig's fields, made from `select(LLM)` (config.py). Every entry point converts and checks
a value with the same `Setting.convert`, so a value one accepts the others accept
(tests/unit/test_settings_table.py). `Setting.where` says which entry points take a setting.

Stdlib only: the HTTP process and `axon --help` import it, torch must not load with it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from axon import speculative_config
from axon.setting import (
    DTYPE_NAMES,
    DTYPES,
    ENGINE,
    EVERYWHERE,
    GENERATE,
    LLM,
    SERVE,
    SPEC,
    Setting,
    parse_mm_limits,
    parse_size,
)

__all__ = [  # the table's own names, and those of setting.py its users need
    "DTYPES", "DTYPE_NAMES", "ENGINE", "EVERYWHERE", "GENERATE", "LLM", "SERVE", "SETTINGS",
    "SPEC", "TABLE", "Setting", "add_flags", "engine_kwargs", "parse_mm_limits", "parse_size",
    "select",
]  # fmt: skip

_DTYPE_RULE = f"must be auto or one of {sorted(DTYPE_NAMES)}"
# The KV cache's 8-bit types (layers/kv_quant.py); fp8_e4m3 on a GPU with float8 only.
_KV_DTYPES = (*DTYPES, "q8_0", "fp8_e4m3")
_KV_DTYPE_RULE = f"must be auto or one of {sorted([*DTYPE_NAMES, 'q8_0', 'fp8_e4m3'])}"
_DTYPE_SHOWN = ("auto", "float32", "bfloat16", "float16")  # --help leaves the short forms out
_MODEL = (SERVE, SPEC)  # what to load for one model: `axon serve MODEL` and a load spec
_NODES = (SERVE, LLM)  # multi-host tensor parallelism: `axon serve`'s multinode flags
_MAX_IMAGES = 16


def _min(low: int) -> dict[str, Any]:
    """The check and rule of a setting that is at least `low`."""
    return {"check": lambda value: value >= low, "rule": f"must be >= {low}"}


def _not_empty(value: str) -> bool:
    return len(value) > 0


def _images(limits: dict) -> dict:
    return {"max_images_per_prompt": limits["image"]} if "image" in limits else {}


def _limits_ok(limits: dict) -> bool:
    counts = limits.values()
    return set(limits) <= {"image"} and all(type(n) is int and n >= 0 for n in counts)


def parse_effort_budgets(text: str) -> dict[str, int]:
    """`--reasoning-effort-budgets`: `low=512,medium=2048,high=8192`, or the same as JSON."""
    if text.lstrip().startswith("{"):
        return json.loads(text)
    pairs = [item.partition("=") for item in text.split(",")]
    if any(not sep for _, sep, _ in pairs):
        raise ValueError(f"expected EFFORT=N pairs, got {text!r}")
    return {effort.strip(): int(count) for effort, _, count in pairs}


def _effort_budgets_ok(budgets: dict) -> bool:
    # none and minimal turn thinking off, so they take no budget.
    return bool(budgets) and all(
        isinstance(effort, str) and effort and effort not in ("none", "minimal")
        and type(count) is int and count >= 0
        for effort, count in budgets.items()
    )  # fmt: skip


def _int_list(values: list) -> bool:
    return all(type(value) is int for value in values)


_INT8_HELP = (
    "int8: every step (prefill, batch-1 and multi-stream decode, MoE experts) on GGUF weights "
    "quantizes activations to 8 bits per block (llama.cpp's Q8_K / Q8_0) and uses integer dot "
    "products; float32: exact (token for token with transformers); auto (default): int8 for "
    "quantized GGUF weights on a CPU with AVX2, else float32"
)

TABLE: tuple[Setting, ...] = (
    # ---- the engine: every entry point ------------------------------------------------------
    Setting("dtype", str, "auto", "weight and compute dtype (auto: float32 on CPU, the "
            "checkpoint's dtype or bfloat16 on GPU)", EVERYWHERE, choices=DTYPES,
            shown=_DTYPE_SHOWN, rule=_DTYPE_RULE, cli_default=True),
    Setting("block_size", int, 16, "tokens per KV block", EVERYWHERE, **_min(1), cli_default=True),
    Setting("max_model_len", int, None, "longest prompt + output (default: the model's "
            "context, capped by the KV cache)", EVERYWHERE, **_min(2)),
    Setting("max_num_seqs", int, 64, "sequences per engine step", EVERYWHERE, **_min(1)),
    Setting("max_num_batched_tokens", int, 2048, "token budget of one engine step",
            EVERYWHERE, **_min(1)),
    Setting("enable_prefix_caching", bool, True, "reuse the KV blocks of a shared prompt prefix",
            EVERYWHERE, cli_default=True),
    Setting("kv_cache_memory", int, None, "KV cache size in bytes, instead of a fraction of "
            "free memory; binary suffixes allowed: 512M, 2G", EVERYWHERE, lambda v: v > 0,
            "must be > 0", parse=parse_size, metavar="BYTES"),
    Setting("limit_mm_per_prompt", dict, None, f"images per request (default {_MAX_IMAGES}); "
            "image=0 loads a vision model text-only", EVERYWHERE, _limits_ok,
            "must be image=N with N >= 0",
            parse=parse_mm_limits, annotation=dict[Literal["image"], int],
            to_engine=_images, metavar="image=N"),
    # It lowers the top of the checkpoint's pixel band (Qwen3.5's reaches 16M pixels), and the
    # memory plan reserves the vision tower's activations for the largest image it allows.
    # None (LLM only): the checkpoint's band.
    Setting("max_image_pixels", int, 1 << 20, "pixels of a resized image", EVERYWHERE, **_min(1),
            nullable=True),
    Setting("image_profile", str, "native", "native: the checkpoint's resize band; fixed448: "
            "neuron's, every image resized to 448x448", EVERYWHERE,
            choices=("native", "fixed448")),
    Setting("task", str, "auto", "embed: pooled hidden states (/v1/embeddings), prefill only; "
            "auto: embed when the checkpoint has a sentence-transformers pooling config",
            EVERYWHERE, choices=("auto", "generate", "embed")),
    # auto is int8 where it measured as accurate as llama.cpp and faster (docs/performance.md)
    Setting("activation_precision", str, "auto", _INT8_HELP, EVERYWHERE,
            choices=("auto", "float32", "int8"), rule="must be float32 or int8, or auto"),
    Setting("kv_cache_dtype", str, "auto", "KV cache element type; auto: float16 with int8 "
            "activations (half the bytes a decode step reads), else dtype's; q8_0: 8-bit "
            "(llama.cpp's), about twice float16's tokens; fp8_e4m3: GPUs with float8",
            EVERYWHERE, choices=_KV_DTYPES, shown=(*_DTYPE_SHOWN, "q8_0", "fp8_e4m3"),
            rule=_KV_DTYPE_RULE),
    Setting("prefix_cache_dir", str, None, "keep the prefix cache's full KV blocks (and "
            "hybrid models' state snapshots) on disk here too, so a restarted server or a "
            "reloaded model serves a known prefix without prefilling it", EVERYWHERE,
            _not_empty, "must not be empty", metavar="DIR"),
    Setting("prefix_cache_disk_size", int, 10 << 30, "cap of --prefix-cache-dir in bytes (default "
            "10G), least recently used files removed past it; binary suffixes allowed: 512M",
            EVERYWHERE, lambda v: v > 0, "must be > 0", parse=parse_size, metavar="BYTES"),
    Setting("prefix_cache_host_size", int, 0, "a host-memory tier of the prefix cache of this "
            "many bytes (0: none; binary suffixes allowed: 8G): full KV blocks the KV cache "
            "evicted come back from host memory, in front of --prefix-cache-dir, instead of "
            "being computed again; for GPUs (on the CPU the KV cache is host memory already)",
            EVERYWHERE, lambda v: v >= 0, "must be >= 0", parse=parse_size, metavar="BYTES"),
    Setting("adaptive_threads", bool, True, "CPU: run n or n - 1 OpenMP threads, whichever "
            "steps faster (a core busy with another process); OMP_NUM_THREADS turns it off",
            EVERYWHERE),
    Setting("speculative_config", dict, None, "speculative decoding, vLLM's object: "
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
            '"prompt_lookup_max": 4}; draft_model takes "model" (and its "quant", "dtype"); mtp '
            "a checkpoint's MTP head (JSON, or key=value pairs)", EVERYWHERE,
            speculative_config.check, "must be a speculative config",
            parse=speculative_config.parse_text, annotation=dict[str, Any],
            metavar="JSON"),
    # ---- one model: what `axon serve MODEL` and a load spec name ------------------------------
    Setting("served_model_name", str, None, "the id MODEL is served under", _MODEL,
            _not_empty, "must not be empty"),
    Setting("quant", str, None, "GGUF file to pick from MODEL's repo, by substring", _MODEL),
    Setting("revision", str, None, "branch, tag or commit of MODEL's repo", _MODEL),
    Setting("chat_template", str, None, "Jinja (or JSON) template file for MODEL's chats",
            _MODEL, _not_empty, "must not be empty", metavar="FILE"),
    Setting("reasoning_effort_budgets", dict, None, "thinking tokens per reasoning_effort "
            "(default low=512,medium=2048,high=8192); the efforts /v1/models lists", _MODEL,
            _effort_budgets_ok, "must be EFFORT=N pairs with N >= 0 (none and minimal are "
            "thinking off)", parse=parse_effort_budgets, annotation=dict[str, int],
            metavar="EFFORT=N,..."),
    Setting("tensor_parallel_size", int, 1, "ranks that shard the model (rank 0 in the engine "
            "process, the others spawned)", (GENERATE, *_MODEL, LLM),
            **_min(1), load_name="tensor_parallel"),
    Setting("devices", list, None, "GPU indices the model's engine sees (CUDA_VISIBLE_DEVICES)",
            (SPEC,), _int_list, "must be a list of integers", annotation=list[int]),
    # ---- multi-host tensor parallelism: node 0 runs the engine (rank 0), the others
    # `axon serve --headless`; every rank meets in the TCP store at master_addr:master_port
    Setting("nnodes", int, 1, "hosts MODEL's ranks span (tensor_parallel_size / nnodes "
            "consecutive ranks each)", _NODES, **_min(1)),
    Setting("node_rank", int, 0, "this host's index; node 0 serves HTTP", _NODES,
            **_min(0)),
    Setting("master_addr", str, "127.0.0.1", "node 0's address (its TCP store)", _NODES),
    Setting("master_port", int, 29500, "node 0's TCP store port", _NODES,
            lambda v: 0 < v < 65536, "must be in [1, 65535]"),
    # ---- LLM only: what the server and the command line leave at the engine's default ---------
    Setting("tokenizer", str, None, "tokenizer directory (default: the model's)", (LLM,)),
    Setting("device", str, "auto", "auto: cuda when there is one, else cpu", (LLM,)),
    Setting("seed", int, 0, "seed of the engine's sampler", (LLM,)),
    Setting("kv_cache_memory_fraction", float, 0.9, "KV cache share of free device memory "
            "(GPU; CPU uses a fixed cap)", (LLM,), lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    Setting("state_snapshot_stride", int, 16, "hybrid (Gated DeltaNet) models with prefix "
            "caching: the recurrent state is snapshotted every this many blocks", (LLM,),
            **_min(1)),
    Setting("num_state_snapshots", int, None, "the snapshot pool (default max_num_seqs), which "
            "shares the cache memory budget with the KV blocks and state slots", (LLM,),
            **_min(0)),
    Setting("enable_vision", bool, True, "False loads a multimodal checkpoint's text model "
            "only, skipping the vision tower's weights and memory", (LLM,)),
    Setting("max_images_per_prompt", int, _MAX_IMAGES, "images per prompt; 0 loads the text "
            "model only (limit_mm_per_prompt={'image': N})", (LLM,), **_min(0)),
    Setting("tp_allreduce", str, "shm", "CPU ranks on one host: shm (shared memory) or gloo; "
            "rank 0's value decides for the group", (LLM,), choices=("shm", "gloo"),
            parse=lambda text: text.strip().lower() or "shm", env="AXON_TP_ALLREDUCE"),
    Setting("tp_step_timeout_s", float, 120.0, "deadline of one tensor-parallel step and "
            "collective (neuron's NEURON_TP_STEP_TIMEOUT_S); a bad or 0 value in the variable "
            "means the default", (LLM,), lambda v: v > 0, "must be > 0",
            env="AXON_TP_STEP_TIMEOUT_S", lenient_env=True),
)  # fmt: skip

SETTINGS: dict[str, Setting] = {setting.name: setting for setting in TABLE}


def select(*needed: str, without: Iterable[str] = ()) -> list[Setting]:
    """The settings taken at every place in `needed` and at none in `without`, in table order."""
    excluded = set(without)
    return [s for s in TABLE if set(needed) <= set(s.where) and not excluded & set(s.where)]


def engine_kwargs(values: Mapping[str, Any]) -> dict[str, Any]:
    """The engine keyword arguments that `values` (settings by name) stand for: None left out,
    `limit_mm_per_prompt` as `max_images_per_prompt`. Raises ValueError for a bad value."""
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        setting = SETTINGS[name]
        if value is None:
            continue
        if setting.to_engine is not None:
            kwargs.update(setting.to_engine(setting.convert(value)))
        else:
            kwargs[name] = value
    return kwargs


def add_flags(group: Any, settings: Iterable[Setting], fill_defaults: bool = False) -> None:
    """Adds a flag for each of `settings` to `group` (a parser or an argument group). Unset, a
    flag is None (the next source's value applies), or with `fill_defaults` the default of a
    `cli_default` setting. Each flag converts its text with `Setting.convert`."""
    for setting in settings:
        flag = "--" + setting.name.replace("_", "-")
        default = setting.default if fill_defaults and setting.cli_default else None
        if setting.kind is bool:
            shown = "on" if setting.default else "off"
            help_text = f"{setting.help} (default: {shown})"
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
            group.set_defaults(**{setting.name: default})
            continue
        if setting.choices is not None:  # argparse's "invalid choice" names the choices
            listed = "{" + ",".join(setting.shown or setting.choices) + "}"
            kind = {"choices": setting.choices, "metavar": listed}
        else:
            kind = {"type": _flag_type(setting), "metavar": _metavar(setting)}
        group.add_argument(flag, default=default, help=_help(setting), **kind)


def _metavar(setting: Setting) -> str | None:
    return setting.metavar or ("N" if setting.kind is int else None)


def _help(setting: Setting) -> str:
    if setting.default is None or "default" in setting.help:
        return setting.help
    return f"{setting.help} (default: {setting.default})"


def _flag_type(setting: Setting) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return setting.convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = setting.name
    return convert
