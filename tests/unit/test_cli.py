"""The `axon` command line: parsing, engine and sampling arguments, the chat loop on a fake LLM.

No model: the fake LLM below stands in for `axon.LLM`. `tp-smoke` runs for real (a rank-1
subprocess and a gloo group on the CPU).
"""

from __future__ import annotations

import io

import pytest

from axon.cli import (
    build_parser,
    engine_args_from_namespace,
    main,
    parse_size,
    run_chat,
    run_generate,
    sampling_kwargs_from_namespace,
)
from axon.sampling_params import SamplingParams


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_generate_defaults():
    ns = parse("generate", "--model", "/models/qwen3", "--prompt", "The capital of France is")
    assert ns.command == "generate"
    assert ns.model == "/models/qwen3"
    assert ns.prompt == "The capital of France is"
    assert engine_args_from_namespace(ns) == {
        "dtype": "auto",
        "block_size": 16,
        "enable_prefix_caching": True,
    }
    assert sampling_kwargs_from_namespace(ns) == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 0,
        "max_tokens": 128,
        "seed": None,
    }


def test_chat_takes_every_engine_flag():
    ns = parse(
        "chat",
        "--model", "m",
        "--system", "Be brief.",
        "--dtype", "bfloat16",
        "--block-size", "32",
        "--max-model-len", "4096",
        "--max-num-seqs", "8",
        "--max-num-batched-tokens", "2048",
        "--no-enable-prefix-caching",
        "--kv-cache-memory", "512M",
    )  # fmt: skip
    assert ns.command == "chat"
    assert ns.system == "Be brief."
    assert engine_args_from_namespace(ns) == {
        "dtype": "bfloat16",
        "block_size": 32,
        "max_model_len": 4096,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "enable_prefix_caching": False,
        "kv_cache_memory": 512 * 2**20,
    }


def test_engine_args_leave_out_model():
    ns = parse("generate", "--model", "m", "--prompt", "x")
    assert "model" not in engine_args_from_namespace(ns)


def test_sampling_flags_make_valid_sampling_params():
    ns = parse(
        "generate", "--model", "m", "--prompt", "x",
        "--temperature", "0", "--top-p", "0.9", "--top-k", "-1", "--max-tokens", "7",
        "--seed", "3",
    )  # fmt: skip
    params = SamplingParams(**sampling_kwargs_from_namespace(ns))
    assert params.greedy
    assert (params.top_p, params.top_k, params.max_tokens, params.seed) == (0.9, 0, 7, 3)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1024", 1024),
        ("100B", 100),
        ("1k", 1024),
        ("512M", 512 * 2**20),
        ("512MB", 512 * 2**20),
        ("512MiB", 512 * 2**20),
        ("2G", 2 * 2**30),
        ("2g", 2 * 2**30),
        ("1.5G", 3 * 2**29),
        (" 4 GiB ", 4 * 2**30),
        ("1T", 2**40),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "abc", "-1G", "1.5", "1X", "2 G B", "0x10", "1e9"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["serve-everything"],
        ["generate", "--prompt", "x"],  # no --model
        ["generate", "--model", "m"],  # no --prompt
        ["generate", "--model", "m", "--prompt", "x", "--dtype", "int8"],
        ["generate", "--model", "m", "--prompt", "x", "--block-size", "0"],
        ["generate", "--model", "m", "--prompt", "x", "--max-model-len", "-5"],
        ["generate", "--model", "m", "--prompt", "x", "--max-num-seqs", "two"],
        ["generate", "--model", "m", "--prompt", "x", "--kv-cache-memory", "lots"],
        ["generate", "--model", "m", "--prompt", "x", "--kv-cache-memory", "0"],
        ["generate", "--model", "m", "--prompt", "x", "--temperature", "-0.1"],
        ["generate", "--model", "m", "--prompt", "x", "--top-p", "0"],
        ["generate", "--model", "m", "--prompt", "x", "--top-p", "1.5"],
        ["generate", "--model", "m", "--prompt", "x", "--top-k", "-2"],
        ["generate", "--model", "m", "--prompt", "x", "--max-tokens", "0"],
        ["generate", "--model", "m", "--prompt", "x", "--seed", "-1"],
        ["chat", "--model", "m", "--prompt", "x"],  # chat takes no --prompt
    ],
)
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "generate" in out and "chat" in out


def test_missing_model_directory_fails_before_loading(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["generate", "--model", str(missing), "--prompt", "x"]) == 1
    assert "no-such-model" in capsys.readouterr().err


class FakeTokenizer:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens):
        assert add_special_tokens is False
        return [ord(c) for c in text]


class FakeLLM:
    """Answers every prompt with a fixed reply, in two deltas; records what it was asked."""

    def __init__(self, reply: str = "Paris."):
        self.tokenizer = FakeTokenizer()
        self.reply = reply
        self.prompts: list = []

    def stream(self, prompt, sampling_params):
        self.prompts.append(prompt)
        half = len(self.reply) // 2
        yield self.reply[:half]
        yield self.reply[half:]


def decoded(prompt: dict) -> str:
    return "".join(chr(t) for t in prompt["prompt_token_ids"])


def test_run_generate_streams_the_text():
    llm, out = FakeLLM(" Paris."), io.StringIO()
    assert run_generate(llm, "The capital of France is", None, out) == " Paris."
    assert out.getvalue() == " Paris.\n"
    assert llm.prompts == ["The capital of France is"]


def test_chat_keeps_the_conversation_and_resets():
    llm, out = FakeLLM(), io.StringIO()
    lines = iter(["Hi", "", "And Italy?", "/reset", "Hello", "/exit", "never read"])
    messages = run_chat(llm, None, lambda _prompt: next(lines), out, system="S")
    assert [decoded(p) for p in llm.prompts] == [
        "<system>S<user>Hi<assistant>",
        "<system>S<user>Hi<assistant>Paris.<user>And Italy?<assistant>",
        "<system>S<user>Hello<assistant>",
    ]
    assert messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Paris."},
    ]
    assert "(conversation cleared)" in out.getvalue()


def test_chat_quits_at_end_of_input():
    def read_line(_prompt):
        raise EOFError

    assert run_chat(FakeLLM(), None, read_line, io.StringIO()) == []


def test_tensor_parallel_size_reaches_the_engine():
    ns = parse("generate", "--model", "/m", "--prompt", "x", "--tensor-parallel-size", "2")
    assert engine_args_from_namespace(ns)["tensor_parallel_size"] == 2


def test_tp_smoke_all_reduces_over_two_cpu_ranks(capsys):
    # A real rank-1 process and a gloo group: every rank must observe the sum 2.
    assert main(["tp-smoke", "--tp-size", "2", "--device", "cpu", "--timeout", "60"]) == 0
    assert capsys.readouterr().out.strip() == "status=ok tp_size=2 devices=cpu,cpu"


def test_tp_smoke_without_the_devices_fails_with_the_reason(capsys):
    assert main(["tp-smoke", "--tp-size", "2", "--device", "cuda", "--devices", "0,1"]) == 1
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("devices", ["0,x", "1,1", "-1"])
def test_tp_smoke_rejects_bad_device_lists(devices, capsys):
    with pytest.raises(SystemExit):
        parse("tp-smoke", "--tp-size", "2", "--devices", devices)
