"""Which worker runs what under `-n auto --dist loadfile`, so that the two workers finish together
and no session server starts twice.

Work is handed out a unit at a time, in the collection order this module sets: longest first
(by FILE_SECONDS, else a few tenths of a second a test), so the last units handed out are short
and the worker that finishes first idles little. A unit is a file, or one SHARED group of files:
those use one session-scoped server (or a costly import) between them, which a second worker
would start again.
"""

from __future__ import annotations

from collections import Counter

import pytest

# Seconds each file over 7 s took in a two-worker run (`--durations=0`, summed per file); a
# rough guide to the order, not a limit. A file not listed counts SECONDS_PER_TEST a test.
FILE_SECONDS = {
    "tests/parsers/test_speculative_structured.py": 50,
    "tests/server/test_on_demand.py": 44,
    "tests/faults/test_engine_faults.py": 30,
    "tests/faults/test_recovery_faults.py": 28,
    "tests/engine/test_engine_process.py": 26,
    "tests/model/test_qwen3_5_serve.py": 24,
    "tests/quant/test_gguf_moe.py": 24,
    "tests/server/test_tensor_parallel_serve.py": 20,
    "tests/faults/test_admission.py": 19,
    "tests/faults/test_big_answers.py": 19,
    "tests/clients/test_template_loops.py": 19,
    "tests/faults/test_hostile_input.py": 18,
    "tests/server/test_chat_page.py": 17,
    "tests/clients/test_lm_eval.py": 15,
    "tests/engine/test_shm_allreduce.py": 15,
    "tests/quant/test_gguf_models.py": 14,
    "tests/quant/test_int8_activations.py": 14,
    "tests/model/test_qwen3_5.py": 14,
    "tests/quant/test_ggml_cpu.py": 14,
    "tests/faults/test_http_edge.py": 13,
    "tests/server/test_lifecycle.py": 13,
    "tests/engine/test_tensor_parallel_moe.py": 13,
    "tests/server/test_prefix_disk_cache.py": 12,
    "tests/server/test_anthropic.py": 11,
    "tests/engine/test_tensor_parallel_multinode.py": 11,
    "tests/clients/test_ollama.py": 10,
    "tests/quant/test_gguf_qwen3_5.py": 10,
    "tests/quant/test_demo_model.py": 10,
    "tests/faults/test_filesystem_exposure.py": 9,
    "tests/parsers/test_responses_text_format.py": 9,
    "tests/server/test_embeddings.py": 9,
    "tests/engine/test_prefix_disk_cache.py": 8,
    "tests/parsers/test_structured_output.py": 8,
    "tests/parsers/test_reasoning_budget.py": 8,
    "tests/clients/test_mistral_template.py": 8,
    "tests/engine/test_speculative.py": 7,
    "tests/clients/test_ollama_on_demand.py": 7,
}
SECONDS_PER_TEST = 0.05

# Files sharing a session-scoped server, each group named by the fixture it shares.
SHARED = {
    "server": (  # tests/server/conftest.py's `server` and `thinking_server`
        "tests/server/test_anthropic.py",
        "tests/server/test_anthropic_agents.py",
        "tests/server/test_bench_cli.py",
        "tests/server/test_errors.py",
        "tests/server/test_field_audit.py",
        "tests/server/test_openai_api.py",
        "tests/server/test_prompt_logprobs.py",
        "tests/server/test_utility_routes.py",
    ),
    "byte_server": (  # tests/parsers/conftest.py's
        "tests/parsers/test_responses_text_format.py",
        "tests/parsers/test_structured_output.py",
        "tests/parsers/test_tool_call_cut_off.py",
    ),
    "qwen3_server": ("tests/clients/",),  # tests/clients/conftest.py's, and the clients' imports
}
_GROUP_OF = {path: group for group, paths in SHARED.items() for path in paths}


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its file, or the SHARED group the file belongs to."""
    file = nodeid.split("::", 1)[0]
    for path, group in _GROUP_OF.items():
        if file == path or (path.endswith("/") and file.startswith(path)):
            return f"shared:{group}"
    return file


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder `items` by work unit, longest unit first; a unit's tests stay in their order."""
    files = [item.nodeid.split("::", 1)[0] for item in items]
    seconds = {
        file: FILE_SECONDS.get(file, count * SECONDS_PER_TEST)
        for file, count in Counter(files).items()
    }
    units = [unit_of(file) for file in files]
    weight = Counter()
    for file in dict.fromkeys(files):
        weight[unit_of(file)] += seconds[file]
    first = {unit: index for index, unit in reversed(list(enumerate(units)))}
    order = sorted(range(len(items)), key=lambda i: (-weight[units[i]], first[units[i]], i))
    items[:] = [items[index] for index in order]


def make_scheduler(config: pytest.Config, log):
    """xdist's loadfile scheduling with SHARED's groups as single units, in collection order."""
    from xdist.scheduler import LoadFileScheduling  # lazy: the controller of an xdist run only

    class SharedUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return SharedUnitScheduling(config, log)
