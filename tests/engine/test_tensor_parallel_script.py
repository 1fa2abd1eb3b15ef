"""A user's script without `if __name__ == "__main__":` runs LLM(..., tensor_parallel_size=2)
at its top level, as vLLM's quick-start scripts do: its ranks are programs of their own, so
nothing of the script runs again in them, and it prints what TP=1 generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import axon
from axon import LLM, SamplingParams
from tests.engine.test_tensor_parallel import ENGINE_ARGS, PROMPT_LENGTHS
from tests.model.tiny_models import get_tiny_model, random_prompts

SCRIPT = """\
import json

from axon import LLM, SamplingParams

with open("runs.txt", "a") as runs:
    runs.write("script body ran\\n")

llm = LLM({model!r}, tensor_parallel_size=2, **{engine_args!r})
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
outputs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], params)
print("TOKENS " + json.dumps([output.outputs[0].token_ids for output in outputs]))
"""


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return get_tiny_model("qwen3", tiny_model_root)


def _environment() -> dict[str, str]:
    """This process's environment, with the `axon` it imported first on the script's path."""
    source = str(Path(axon.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([source, path] if path else [source])}


def test_unguarded_script_with_two_ranks(tiny, tmp_path):
    prompts = random_prompts(PROMPT_LENGTHS, seed=11)
    script = tmp_path / "quickstart.py"
    script.write_text(SCRIPT.format(model=str(tiny.path), engine_args=ENGINE_ARGS, prompts=prompts))
    result = subprocess.run(
        [sys.executable, script.name],
        cwd=tmp_path,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "runs.txt").read_text().splitlines() == ["script body ran"]

    (line,) = [line for line in result.stdout.splitlines() if line.startswith("TOKENS ")]
    single = LLM(str(tiny.path), **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = single.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert json.loads(line.removeprefix("TOKENS ")) == [o.outputs[0].token_ids for o in outputs]
