"""`/v1/embeddings`: a tiny random Qwen3 with a sentence-transformers pooling config, checked
against transformers' hidden states pooled here with torch. The engine is driven in-process for
the numerics (batching, chunked prefill, prefix cache), and through a real `axon serve` with the
official `openai` client for the route (floats, base64, token ids, dimensions, errors)."""

from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path

import httpx
import openai
import pytest
import torch

from axon.config import EngineConfig
from axon.engine.engine_core import EngineCore
from axon.sampling_params import SamplingParams

from .conftest import _wait_until_serving, spawn_serve, stop_server, write_tiny_qwen3

EMBED_ID = "tiny-embed"
BATCH_TOKENS = 32  # a step's token budget: the long prompts below are prefilled in chunks
LENGTHS = (5, 40, 77, 16)


def write_embedder(path: Path, mode: str, normalize: bool, matryoshka=None) -> Path:
    """The tiny Qwen3 as a sentence-transformers model pooling by `mode` ("lasttoken" or
    "mean_tokens"), with a Normalize module if `normalize`, Matryoshka dims if given."""
    write_tiny_qwen3(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": mode == "mean_tokens"}
    pooling["pooling_mode_lasttoken"] = mode == "lasttoken"
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if matryoshka is not None:
        st_config = {"matryoshka_dimensions": matryoshka}
        (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return path


def reference(path: Path, prompts: list[list[int]], mode: str, normalize: bool) -> torch.Tensor:
    """transformers' final (normed) hidden states of each prompt, pooled and normalised here."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]  # [L, hidden]
            rows.append(hidden[-1] if mode == "lasttoken" else hidden.mean(0))
    vectors = torch.stack(rows)
    return torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors


def prompts_of(lengths, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in lengths]


def embed(core: EngineCore, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt queued at once and stepped to the end; their vectors in order."""
    vectors = {}
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, SamplingParams(max_tokens=1))
    while core.has_unfinished():
        for update in core.step():
            if update.embedding is not None:
                vectors[update.request_id] = update.embedding
    return torch.tensor([vectors[f"r{i}"] for i in range(len(prompts))])


@pytest.fixture(scope="module")
def last_model(tmp_path_factory) -> Path:
    return write_embedder(tmp_path_factory.mktemp("embed_last"), "lasttoken", True)


@pytest.fixture(scope="module")
def mean_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("embed_mean")
    return write_embedder(path, "mean_tokens", False, matryoshka=[16, 32, 64])


def engine(path: Path, **overrides) -> EngineCore:
    kwargs = dict(dtype="float32", device="cpu", max_num_batched_tokens=BATCH_TOKENS)
    return EngineCore(EngineConfig(model=str(path), kv_cache_memory=4 << 20, **kwargs | overrides))


@pytest.mark.parametrize(
    ("fixture", "mode", "normalize"),
    [
        ("last_model", "lasttoken", True),
        ("mean_model", "mean_tokens", False),
    ],
)
def test_engine_matches_transformers_batched_and_chunked(request, fixture, mode, normalize):
    path = request.getfixturevalue(fixture)
    core = engine(path)
    assert core.task == "embed"  # detected from modules.json
    prompts = prompts_of(LENGTHS)
    expected = reference(path, prompts, mode, normalize)
    batched = embed(core, prompts)
    torch.testing.assert_close(batched, expected, atol=1e-5, rtol=0)
    alone = torch.cat([embed(core, [ids]) for ids in prompts])  # prefix cache warm now
    torch.testing.assert_close(alone, batched, atol=1e-5, rtol=0)
    stats = core.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]  # no KV kept by finished prompts
    # The last token may come from cached blocks; mean pooling must see every row itself.
    assert (stats["prefix_cache_hits"] > 0) == (mode == "lasttoken")
    if normalize:
        torch.testing.assert_close(batched.norm(dim=-1), torch.ones(len(prompts)))


def test_a_bare_base_model_checkpoint_loads(tmp_path, last_model):
    """Qwen3-Embedding's layout: the base model's names (`layers.0...`, no `model.` prefix)
    and no LM head; it loads as an embedder and gives the same vectors."""
    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"
    shutil.copytree(last_model, bare)
    tensors = load_file(str(bare / "model.safetensors"))
    tensors = {k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"}
    assert "embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
    save_file(tensors, str(bare / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    prompts = prompts_of(LENGTHS[:2])
    got = embed(engine(bare), prompts)
    torch.testing.assert_close(
        got, reference(last_model, prompts, "lasttoken", True), atol=1e-5, rtol=0
    )
    with pytest.raises(ValueError, match="lm_head"):  # generating needs the (untied) head
        engine(bare, task="generate")


def test_task_generate_and_embed_override(tmp_path, last_model):
    plain = write_tiny_qwen3(tmp_path / "plain")
    assert engine(plain).task == "generate"
    forced = engine(plain, task="embed")  # no pooling config: last token, normalised
    prompts = prompts_of((9, 33))
    torch.testing.assert_close(
        embed(forced, prompts), reference(plain, prompts, "lasttoken", True), atol=1e-5, rtol=0
    )
    assert engine(last_model, task="generate").task == "generate"
    with pytest.raises(ValueError, match="task"):
        EngineConfig(model=str(plain), task="classify")


# ---- through axon serve -------------------------------------------------------------------


@pytest.fixture(scope="module")
def embed_server(last_model, mean_model, tmp_path_factory):
    plain = write_tiny_qwen3(tmp_path_factory.mktemp("embed_plain"))
    args = [str(last_model), "--port", "0", "--served-model-name", EMBED_ID, "--dtype", "float32"]
    args += ["--max-model-len", "128", "--max-num-batched-tokens", str(BATCH_TOKENS)]
    args += ["--kv-cache-memory", "4M", "--log-level", "warning"]
    allowed = str(tmp_path_factory.getbasetemp())  # holds all three checkpoints
    server = spawn_serve(args, {"AXON_ALLOWED_LOCAL_MODEL_PATHS": allowed})
    try:
        # The first model loads before any other: two loads at once can race in transformers'
        # lazy imports (ImportError of AutoTokenizer seen here).
        _wait_until_serving(server, model_id=EMBED_ID)
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            for path, name in ((mean_model, "tiny-mean"), (plain, "tiny-plain")):
                spec = {"model_id": str(path), "served_model_name": name, "dtype": "float32"}
                spec |= {"kv_cache_memory": "4M", "max_model_len": 128}
                response = http.post("/models/load", json=spec)
                assert response.status_code == 200, response.text + "".join(server.log)
        yield server
    finally:
        stop_server(server)


@pytest.fixture()
def client(embed_server):
    with openai.OpenAI(base_url=embed_server.openai_url, api_key="x", max_retries=0) as c:
        yield c


def test_openai_client_float_base64_and_token_ids(client, last_model):
    prompts = prompts_of((6, 70, 3), seed=1)
    expected = reference(last_model, prompts, "lasttoken", True)
    floats = client.embeddings.create(model=EMBED_ID, input=prompts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == EMBED_ID
    got = torch.tensor([d.embedding for d in floats.data])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == 79
    raw = client.embeddings.with_raw_response.create(
        model=EMBED_ID, input=prompts[1], encoding_format="base64", user="someone"
    ).http_response.json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == floats.data[1].embedding
    single = client.embeddings.create(model=EMBED_ID, input=prompts[2])  # the client's base64
    torch.testing.assert_close(
        torch.tensor(single.data[0].embedding), expected[2], atol=1e-5, rtol=0
    )


def test_text_input_and_dimensions(client, mean_model):
    texts = ["hello world", "tell me a story w40 w41"]
    result = client.embeddings.create(model="tiny-mean", input=texts, dimensions=32)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(mean_model)
    full = reference(mean_model, [tokenizer.encode(t) for t in texts], "mean_tokens", False)
    got = torch.tensor([d.embedding for d in result.data])
    # No Normalize module: truncated, not renormalised (as sentence-transformers' truncate_dim).
    torch.testing.assert_close(got, full[:, :32], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("model", "kwargs", "param", "code"),
    [
        ("tiny-plain", {"input": "hello"}, "model", None),
        (EMBED_ID, {"input": []}, "input", None),
        (EMBED_ID, {"input": ""}, "input", None),
        (EMBED_ID, {"input": [[5], []]}, "input", None),
        (EMBED_ID, {"input": [300]}, "input", None),
        (EMBED_ID, {"input": [5] * 129}, "input", "context_length_exceeded"),
        (EMBED_ID, {"input": "hello", "dimensions": 16}, "dimensions", None),
        ("tiny-mean", {"input": "hello", "dimensions": 20}, "dimensions", None),
        (EMBED_ID, {"input": "hello", "encoding_format": "int8"}, "encoding_format", None),
    ],
)
def test_errors_are_400_naming_the_field(client, model, kwargs, param, code):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=model, **kwargs)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param
    assert error["code"] == code


def test_embed_model_refuses_generation(client):
    for create in (
        lambda: client.chat.completions.create(
            model=EMBED_ID, messages=[{"role": "user", "content": "hello"}]
        ),
        lambda: client.completions.create(model=EMBED_ID, prompt="hello"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            create()
        assert caught.value.body["param"] == "model"
        assert "/v1/embeddings" in caught.value.body["message"]


def test_models_list_the_embeddings_capability(embed_server):
    models = httpx.get(embed_server.base_url + "/models", timeout=10).json()
    capabilities = {model["id"]: model["capabilities"] for model in models}
    assert capabilities[EMBED_ID] == capabilities["tiny-mean"] == ["embeddings"]
    assert capabilities["tiny-plain"] == ["text"]
