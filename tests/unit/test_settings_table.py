"""The engine settings table (axon/settings.py) and its entry points: `axon generate`'s and `axon
serve`'s flags, the /models/load body, the config file ([engine], [[default_models]]) and LLM's
keyword arguments take exactly the settings the table gives them, and accept or refuse a value
alike. LLM is checked without a model: its engine is replaced by one that stops at once."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

import pytest
from pydantic import ValidationError

from axon.cli import add_engine_args, build_parser, engine_args_from_namespace
from axon.config import EngineConfig
from axon.server.config import config_from_mapping
from axon.server.lifecycle.multinode import multinode_args
from axon.server.schemas.node_protocol import EngineArgs, ModelSpec
from axon.server.serve_args import add_serve_args, config_from_namespace
from axon.settings import ENGINE, GENERATE, LLM, SERVE, SETTINGS, SPEC, TABLE, Setting, select

MODEL = "m.gguf"  # a GGUF name: activation_precision int8 applies to it
# name: (a valid value, an invalid one); every setting has an entry
SAMPLES: dict[str, tuple[Any, Any]] = {
    "dtype": ("bf16", "int8"),
    "block_size": (32, 0),
    "max_model_len": (4096, 1),
    "max_num_seqs": (8, 0),
    "max_num_batched_tokens": (512, "many"),
    "enable_prefix_caching": (False, "maybe"),
    "kv_cache_memory": ("512M", "lots"),
    "limit_mm_per_prompt": ({"image": 2}, {"video": 1}),
    "max_image_pixels": (4096, 0),
    "image_profile": ("fixed448", "square"),
    "task": ("embed", "classify"),
    "activation_precision": ("int8", "int4"),
    "kv_cache_dtype": ("float16", "int8"),
    "prefix_cache_dir": ("/var/cache/axon-prefix", ""),
    "prefix_cache_disk_size": ("10G", "lots"),
    "prefix_cache_host_size": ("8G", -1),
    "adaptive_threads": (False, "maybe"),
    "speculative_config": ({"method": "ngram", "num_speculative_tokens": 3}, {"method": "eagle"}),
    "served_model_name": ("alias", ""),
    "quant": ("Q4_K_M", 4),
    "revision": ("main", 4),
    "chat_template": ("t.jinja", ""),
    "reasoning_effort_budgets": ({"low": 4, "high": 64}, {"none": 4}),
    "tensor_parallel_size": (2, 0),
    "devices": ([0, 1], ["x"]),
    "nnodes": (1, 0),
    "node_rank": (0, -1),
    "master_addr": ("10.0.0.1", 4),
    "master_port": (29501, 70000),
    "tokenizer": ("/tokenizer", 4),
    "device": ("cpu", 4),
    "seed": (3, "x"),
    "kv_cache_memory_fraction": (0.5, 1.5),
    "state_snapshot_stride": (4, 0),
    "num_state_snapshots": (0, -1),
    "enable_vision": (False, "maybe"),
    "max_images_per_prompt": (2, -1),
    "tp_allreduce": ("gloo", "tcp"),
    "tp_step_timeout_s": (30.0, 0),
}
# `axon serve`'s own options: the server's, not an engine's
SERVER_OPTIONS = {
    "help", "model", "config", "host", "port", "api_key", "shutdown_grace", "log_level",
    "allowed_local_model_path", "allowed_media_domains", "allowed_local_media_path", "no_demo",
    "headless", "chat_template_dir", "admin_api_key",
    "models_dir", "no_load_on_demand", "max_loaded_models", "idle_unload_s", "on_demand_wait_s",
}  # fmt: skip


class _Built(Exception):
    """Raised by the stand-in engine: LLM took its arguments."""


class _NoEngine:
    def __init__(self, config):
        raise _Built


def _cli_args(setting: Setting, value: Any) -> list[str] | None:
    """The flag that spells `value`, or None where no command line can (a number for a string)."""
    flag = "--" + setting.name.replace("_", "-")
    if value is True or value is False:
        return [flag if value else "--no-" + flag[2:]]
    if setting.kind is bool:
        return [f"{flag}={value}"]
    if isinstance(value, dict):
        return [flag, ",".join(f"{key}={count}" for key, count in value.items())]
    if isinstance(value, list):
        return [flag, ",".join(map(str, value))]
    if setting.kind is str and not isinstance(value, str):
        return None
    return [flag, str(value)]


def _generate(setting: Setting, value: Any) -> bool | None:
    args = _cli_args(setting, value)
    if args is None:
        return None
    try:
        ns = build_parser().parse_args(["generate", "--model", MODEL, "--prompt", "x", *args])
    except SystemExit:
        return False
    return setting.name in engine_args_from_namespace(ns)


def _serve(setting: Setting, value: Any) -> bool | None:
    args = _cli_args(setting, value)
    if args is None:
        return None
    try:
        ns = build_parser().parse_args(["serve", MODEL, *args])
        config_from_namespace(ns, environ={})
        multinode_args(ns)
    except (SystemExit, ValueError):
        return False
    return True


def _load(setting: Setting, value: Any) -> bool:
    try:
        ModelSpec.model_validate({"model_id": MODEL, setting.field: value})
    except ValidationError:
        return False
    return True


def _config(setting: Setting, value: Any) -> bool:
    """[engine] for an engine setting, else a [[default_models]] entry (for a spec setting)."""
    if SPEC in setting.where and ENGINE not in setting.where:
        data = {"default_models": [{"model_id": MODEL, setting.field: value}]}
    else:
        data = {"engine": {setting.field: value}}
    try:
        config_from_mapping(data)
    except ValueError:
        return False
    return True


def _llm(setting: Setting, value: Any) -> bool:
    from axon import LLM as OfflineLLM

    try:
        OfflineLLM(MODEL, **{setting.name: value})
    except _Built:
        return True
    except ValueError:
        return False
    raise AssertionError("the stand-in engine was not reached")


ENTRY_POINTS = {  # entry point: (how it is tried, the place in Setting.where it takes)
    "generate": (_generate, {GENERATE}),
    "serve": (_serve, {SERVE}),
    "load": (_load, {ENGINE, SPEC}),
    "config": (_config, {ENGINE, SPEC}),
    "llm": (_llm, {LLM}),
}


@pytest.fixture
def no_engine(monkeypatch, tmp_path):
    import axon.engine.llm

    monkeypatch.setattr(axon.engine.llm, "EngineCore", _NoEngine)
    monkeypatch.chdir(tmp_path)  # no ./axon.toml


def test_every_setting_has_samples():
    assert set(SAMPLES) == set(SETTINGS)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_entry_points_take_the_same_settings_and_values(name, no_engine):
    setting = SETTINGS[name]
    valid, invalid = SAMPLES[name]
    for entry, (attempt, places) in ENTRY_POINTS.items():
        takes = bool(places & set(setting.where))
        assert attempt(setting, valid) is takes, f"{entry} {'refused' if takes else 'took'} it"
        if takes:
            assert attempt(setting, invalid) in (False, None), f"{entry} took {invalid!r}"


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_refusal_names_the_setting(name):
    setting = SETTINGS[name]
    with pytest.raises(ValueError, match=name):
        setting.convert(SAMPLES[name][1])


def test_generate_flags_are_the_table():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {action.dest for action in parser._actions} - {"help", "model"}
    assert flags == {setting.name for setting in select(GENERATE)}


def test_serve_flags_are_the_table_and_the_server():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    flags = {action.dest for action in parser._actions} - SERVER_OPTIONS
    assert flags == {setting.name for setting in select(SERVE)}


def test_load_fields_are_the_table():
    engine = {setting.field for setting in select(ENGINE)}
    assert set(EngineArgs.model_fields) == engine
    spec = set(ModelSpec.model_fields) - {"model_id", "harness"}  # which model, not how
    assert spec == engine | {setting.field for setting in select(SPEC)}


def test_llm_keywords_are_the_table():
    engine_fields = {f.name for f in fields(EngineConfig)} - {"model"}
    assert engine_fields == {s.name for s in select(LLM) if s.to_engine is None}
    with pytest.raises(ValueError, match="unknown engine arguments \\['gpu_memory_utilisation'\\]"):
        EngineConfig.from_kwargs(MODEL, gpu_memory_utilisation=0.5)


def test_names_are_unique_and_defaults_valid():
    assert len({s.name for s in TABLE}) == len(TABLE)
    assert len({s.field for s in TABLE}) == len(TABLE)
    for setting in TABLE:
        assert setting.convert(setting.default) == setting.default, setting.name


def test_a_size_means_the_same_bytes_everywhere():
    flags = ["generate", "--model", MODEL, "--prompt", "x", "--kv-cache-memory", "512M"]
    from_flag = engine_args_from_namespace(build_parser().parse_args(flags))["kv_cache_memory"]
    from_load = ModelSpec(model_id=MODEL, kv_cache_memory="512M").kv_cache_memory
    from_llm = EngineConfig.from_kwargs(MODEL, kv_cache_memory="512M").kv_cache_memory
    assert from_flag == from_load == from_llm == 512 * 2**20


def test_env_settings_are_read_into_the_config(monkeypatch):
    monkeypatch.setenv("AXON_TP_ALLREDUCE", " GLOO ")
    monkeypatch.setenv("AXON_TP_STEP_TIMEOUT_S", "7.5")
    config = EngineConfig(model=MODEL)
    assert (config.tp_allreduce, config.tp_step_timeout_s) == ("gloo", 7.5)
    assert EngineConfig(model=MODEL, tp_allreduce="shm").tp_allreduce == "shm"  # given wins
    monkeypatch.setenv("AXON_TP_STEP_TIMEOUT_S", "soon")  # a bad value: the default, as ever
    assert EngineConfig(model=MODEL).tp_step_timeout_s == 120.0
    monkeypatch.setenv("AXON_TP_ALLREDUCE", "tcp")
    with pytest.raises(ValueError, match="AXON_TP_ALLREDUCE must be shm or gloo, got 'tcp'"):
        EngineConfig(model=MODEL)
