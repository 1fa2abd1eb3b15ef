"""The Ollama API with the official `ollama` client against `axon serve`: the byte-level tiny
Qwen3 carrying Qwen3's real chat template (tools, thinking), served with an alias, and a tiny
embedding model loaded beside it. Chat and generate (whole and streamed), `format`, a tool loop,
embeddings, the model routes, options refused by name, and Ollama's error shape and NDJSON
framing over raw HTTP."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from axon.server.schemas.ollama import Message, chat_message
from tests.clients.conftest import CITY_SCHEMA, MODEL_ID, RESULT, TEMPLATE
from tests.parsers.conftest import byte_model_with_corpus_template
from tests.server.conftest import _wait_until_serving, spawn_serve, stop_server
from tests.server.test_embeddings import write_embedder

ollama = pytest.importorskip("ollama")

ALIAS = "llama3.2"
EMBED_ID = "tiny-embed"
MAX_MODEL_LEN = 2048
GREEDY = {"temperature": 0, "num_predict": 12}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather.", "parameters": CITY_SCHEMA},
}
HELLO = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = byte_model_with_corpus_template(tmp_path_factory.mktemp("tiny_ollama"), TEMPLATE)
    embedder = write_embedder(tmp_path_factory.mktemp("tiny_ollama_embed"), "lasttoken", True)
    args = [str(model), "--port", "0", "--served-model-name", MODEL_ID, ALIAS]
    args += ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "16M"]
    args += ["--dtype", "float32", "--log-level", "warning"]
    allowed = str(tmp_path_factory.getbasetemp())
    running = spawn_serve(args, {"AXON_ALLOWED_LOCAL_MODEL_PATHS": allowed})
    try:
        _wait_until_serving(running)
        spec = {"model_id": str(embedder), "served_model_name": EMBED_ID, "dtype": "float32"}
        spec |= {"kv_cache_memory": "4M", "max_model_len": 128}
        loaded = httpx.post(running.base_url + "/models/load", json=spec, timeout=120)
        assert loaded.status_code == 200, loaded.text + "".join(running.log)
        yield running
    finally:
        stop_server(running)


@pytest.fixture()
def client(server):
    return ollama.Client(host=server.base_url, timeout=120)


# ---- chat and generate ----------------------------------------------------------------------


def test_chat_streamed_chunks_make_the_whole_greedy_answer(client):
    whole = client.chat(model=MODEL_ID, messages=HELLO, options=GREEDY, think=False, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.model == MODEL_ID and whole.message.role == "assistant"
    assert 0 < whole.eval_count <= 12 and whole.prompt_eval_count > 10
    assert whole.total_duration >= whole.eval_duration > 0
    chunks = list(
        client.chat(model=MODEL_ID, messages=HELLO, options=GREEDY, think=False, stream=True)
    )
    assert [chunk.done for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(chunk.message.content for chunk in chunks) == whole.message.content
    assert chunks[-1].eval_count == whole.eval_count
    assert chunks[-1].done_reason == whole.done_reason


def test_chat_thinking_comes_apart_from_the_content(client):
    """Qwen3 thinks by default: whatever the model writes inside <think> is `thinking`."""
    options = {"temperature": 0, "num_predict": 40}
    whole = client.chat(model=MODEL_ID, messages=HELLO, options=options, think=True, stream=False)
    chunks = list(
        client.chat(model=MODEL_ID, messages=HELLO, options=options, think=True, stream=True)
    )
    assert "<think>" not in (whole.message.content or "")
    streamed = "".join(chunk.message.thinking or "" for chunk in chunks)
    assert streamed == (whole.message.thinking or "")
    budget = client.chat(model=MODEL_ID, messages=HELLO, options=options, think="low", stream=False)
    assert budget.done


def test_generate_whole_streamed_and_raw(client):
    options = {**GREEDY, "seed": 7, "stop": ["\n\n"]}
    whole = client.generate(model=MODEL_ID, prompt="Paris is", options=options, think=False)
    assert whole.done and whole.model == MODEL_ID
    fields = {"model": MODEL_ID, "prompt": "Paris is", "options": options, "think": False}
    chunks = list(client.generate(**fields, stream=True))
    assert "".join(chunk.response for chunk in chunks) == whole.response
    assert chunks[-1].done and chunks[-1].prompt_eval_count == whole.prompt_eval_count
    raw = client.generate(model=MODEL_ID, prompt="Paris is", raw=True, options=GREEDY)
    # The raw prompt is the text alone: far fewer tokens than the templated one.
    assert raw.done and raw.prompt_eval_count < whole.prompt_eval_count
    system = client.generate(model=MODEL_ID, prompt="Hi", system="Be brief.", options=GREEDY)
    assert system.prompt_eval_count > raw.prompt_eval_count


def test_format_json_schema_and_json_are_enforced(client):
    answer = client.chat(
        model=MODEL_ID, messages=HELLO, format=CITY_SCHEMA, think=False, options={"seed": 1}
    )
    jsonschema.validate(json.loads(answer.message.content), CITY_SCHEMA)
    # A random model writes an object until it runs out of tokens: the grammar opened it.
    generated = client.generate(
        model=MODEL_ID, prompt="A JSON object:", format="json", think=False, options=GREEDY
    )
    assert generated.response.startswith("{")


def test_tool_loop_round_trips_calls_and_results(client, server):
    """Ollama has no tool_choice, so the model is not forced to call: the second turn carries
    a call (arguments as an object, Ollama's shape) and the tool's result, which the template
    renders; the answer's prompt count is that prompt's."""
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        *HELLO,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": RESULT, "tool_name": "get_weather"},
    ]
    answer = client.chat(
        model=MODEL_ID, messages=messages, tools=[WEATHER], options=GREEDY, stream=False
    )
    assert answer.done
    chat_messages = [chat_message(Message.model_validate(m)) for m in messages]
    # The client sends a tool as its Tool model keeps it (additionalProperties dropped).
    sent = ollama.Tool.model_validate(WEATHER).model_dump(exclude_none=True)
    prompt, count = rendered_prompt(server, {"messages": chat_messages, "tools": [sent]})
    assert RESULT in prompt and '"city": "Paris"' in prompt and "get_weather" in prompt
    assert answer.prompt_eval_count == count


def rendered_prompt(server, request: dict) -> tuple[str, int]:
    """The prompt axon renders for a chat request, and its token count (two models are served
    here, so each call names one)."""
    body = {"model": MODEL_ID, **request}
    ids = httpx.post(server.base_url + "/tokenize", json=body, timeout=60).json()["tokens"]
    text = httpx.post(
        server.base_url + "/detokenize", json={"model": MODEL_ID, "tokens": ids}, timeout=60
    )
    return text.json()["prompt"], len(ids)


# ---- aliases and model routes ---------------------------------------------------------------


def test_alias_and_latest_tag_answer_under_the_name_sent(client):
    for name in (ALIAS, f"{MODEL_ID}:latest"):
        answer = client.chat(model=name, messages=HELLO, options=GREEDY, stream=False)
        assert answer.model == name and answer.done


def test_tags_ps_show_version(client):
    tags = {m.model: m for m in client.list().models}
    assert {MODEL_ID, ALIAS, EMBED_ID} <= set(tags)
    assert tags[ALIAS].details.parent_model == MODEL_ID and tags[MODEL_ID].size > 0
    assert tags[MODEL_ID].details.family == "qwen3"
    running = {m.model: m for m in client.ps().models}
    assert running[MODEL_ID].context_length == MAX_MODEL_LEN
    assert running[EMBED_ID].context_length == 128
    shown = client.show(MODEL_ID)
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
    assert "<tool_call>" in shown.template
    assert shown.modelinfo["qwen3.context_length"] == MAX_MODEL_LEN
    assert client.show(EMBED_ID).capabilities == ["embedding"]
    assert client.show(ALIAS).details.parent_model == MODEL_ID
    assert httpx.get(str(client._client.base_url) + "/api/version").json()["version"]


def test_pull_of_a_loaded_model_succeeds_and_a_library_name_is_a_400(client):
    assert client.pull(MODEL_ID).status == "success"
    assert [p.status for p in client.pull(ALIAS, stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as refused:
        client.pull("llama3.2-vision")  # Ollama's library: not a source axon has
    assert refused.value.status_code == 400 and "Hugging Face repo id" in refused.value.error


def test_embed_and_embeddings(client, server):
    texts = ["hello world", "the weather in Paris"]
    answer = client.embed(model=EMBED_ID, input=texts)
    assert len(answer.embeddings) == 2 and len(answer.embeddings[0]) == 64
    assert answer.prompt_eval_count > 0
    openai = httpx.post(
        server.openai_url + "/embeddings", json={"model": EMBED_ID, "input": texts}, timeout=60
    ).json()
    assert answer.embeddings[1] == pytest.approx(openai["data"][1]["embedding"], abs=1e-6)
    older = client.embeddings(model=EMBED_ID, prompt=texts[0])
    assert older.embedding == pytest.approx(answer.embeddings[0], abs=1e-6)
    long_text = " ".join(["hello"] * 200)  # 200 tokens, over the embedder's 128
    truncated = client.embed(model=EMBED_ID, input=long_text)  # Ollama cuts to the context
    assert len(truncated.embeddings) == 1
    with pytest.raises(ollama.ResponseError) as too_long:
        client.embed(model=EMBED_ID, input=long_text, truncate=False)
    assert too_long.value.status_code == 400 and "truncate" in too_long.value.error


def test_keep_alive_for_a_startup_model_and_one_loaded_through_the_node_api(client):
    """The startup model is axon's to unload: a positive keep_alive is its idle time (ps's
    expires_at); the node API's model stays until unloaded, so only 0 or negative go."""
    client.chat(model=MODEL_ID, messages=HELLO, options=GREEDY, keep_alive="5m")
    assert running_models(client)[MODEL_ID].expires_at is not None
    client.chat(model=MODEL_ID, messages=[], keep_alive=-1)  # kept: no expiry
    assert running_models(client)[MODEL_ID].expires_at is None
    assert running_models(client)[EMBED_ID].expires_at is None
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=EMBED_ID, input="hello", keep_alive="5m")
    assert refused.value.status_code == 400 and "node API" in refused.value.error
    assert client.embed(model=EMBED_ID, input="hello", keep_alive=-1).embeddings


def running_models(client) -> dict:
    return {m.model: m for m in client.ps().models}


# ---- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"options": {"mirostat": 2}}, "options.mirostat"),
        ({"options": {"num_gpu": 1}}, "options.num_gpu"),
        ({"options": {"not_an_option": 1}}, "options.not_an_option"),
        ({"options": {"num_ctx": MAX_MODEL_LEN + 1}}, "options.num_ctx"),
        ({"options": {"num_ctx": 8}}, "messages"),  # the prompt does not fit its window
        ({"options": {"temperature": "hot"}}, "options.temperature"),
        ({"options": {"num_predict": 0}}, "options.num_predict"),
        ({"keep_alive": "soon"}, "keep_alive"),
        ({"think": "extreme"}, "think"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_chat_refuses_what_it_cannot_honour_by_name(client, fields, named):
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=MODEL_ID, messages=HELLO, stream=False, **fields)
    assert refused.value.status_code == 400 and named in refused.value.error


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"template": "{{ .Prompt }}"}, "template"),
        ({"suffix": "end"}, "suffix"),
        ({"context": [1, 2, 3]}, "context"),
        ({"raw": True, "system": "hi"}, "system"),
    ],
)
def test_generate_refuses_templates_suffix_and_context(client, fields, named):
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model=MODEL_ID, prompt="Paris is", **fields)
    assert refused.value.status_code == 400 and named in refused.value.error


def test_unknown_model_is_a_404(client):
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="no-such-model", messages=HELLO, stream=False)
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error


# ---- raw HTTP: framing and error shapes -----------------------------------------------------


def test_ndjson_framing_streams_by_default(server):
    body = {"model": MODEL_ID, "messages": HELLO, "options": GREEDY, "think": False}
    with httpx.stream("POST", server.base_url + "/api/chat", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert lines[-1]["done"] is True and not any(line["done"] for line in lines[:-1])
    last = lines[-1]
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration"):
        assert isinstance(last[key], int)
    assert last["eval_count"] == 12 or last["done_reason"] == "stop"


def test_error_shapes(server):
    post = lambda path, **kw: httpx.post(server.base_url + path, timeout=60, **kw)  # noqa: E731
    bad_json = post("/api/chat", content=b"{nope")
    assert bad_json.status_code == 400 and isinstance(bad_json.json()["error"], str)
    extra = post("/api/chat", json={"model": MODEL_ID, "messages": HELLO, "nonsense": 1})
    assert extra.status_code == 400 and "nonsense" in extra.json()["error"]
    yaml = post("/api/chat", json={"model": MODEL_ID, "messages": HELLO, "format": "yaml"})
    assert yaml.status_code == 400 and "format" in yaml.json()["error"]
    picture = [{"role": "user", "content": "What is this?", "images": ["iVBORw0KGgo="]}]
    no_vision = post("/api/chat", json={"model": MODEL_ID, "messages": picture, "stream": False})
    assert no_vision.status_code == 400 and "image" in no_vision.json()["error"]
    loaded = post("/api/generate", json={"model": MODEL_ID})
    assert loaded.json()["done_reason"] == "load"
    embed_chat = post("/api/chat", json={"model": EMBED_ID, "messages": HELLO, "stream": False})
    assert embed_chat.status_code == 400 and set(embed_chat.json()) == {"error"}


# ---- in process: the answer's shape, the API key, keep_alive 0 ------------------------------


class _Sample:
    """An engine sample that has written `pieces` so far, one per step."""

    def __init__(self, pieces: list[str]):
        self.pieces, self.step, self.text, self.token_ids = pieces, 0, "", []
        self.finish_reason, self.finished = None, False

    def advance(self) -> None:
        self.text += self.pieces[self.step]
        self.token_ids.append(self.step)
        self.step += 1
        self.finished = self.step == len(self.pieces)
        self.finish_reason = "stop" if self.finished else None

    def new_text(self) -> str:
        return self.pieces[self.step - 1]


class _Generation:
    """Generation's interface over one scripted sample."""

    def __init__(self, pieces: list[str]):
        from types import SimpleNamespace

        self.state = SimpleNamespace(samples=[_Sample(pieces)], prompt_token_ids=[1, 2, 3])

    async def __aiter__(self):
        while not self.state.samples[0].finished:
            self.state.samples[0].advance()
            yield self.state

    async def aclose(self) -> None:
        pass


CALL_TEXT = [
    "<think>\nParis, then.",
    "\n</think>\n\n<tool_call>\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "\n</tool_call>",
]


def _reply():
    from axon.server.chat_output import ChatOutputPlan
    from axon.server.chat_pipeline import PreparedChat
    from axon.server.routes.ollama import Reply
    from axon.tokenizer.parsers import ParserFamily

    plan = ChatOutputPlan(ParserFamily(True, "hermes"), "", [WEATHER], True, True, False, True)
    prepared = PreparedChat("", [1, 2, 3], plan, None, None)
    return Reply(MODEL_ID, prepared, chat=True, raw=False, started_at=0.0)


def test_a_parsed_tool_call_comes_back_in_ollamas_shape_whole_and_streamed():
    """The model's Hermes call (Qwen3's form) as the client parses it: arguments an object,
    thinking apart; streamed, the call comes whole in one line before the last."""
    import asyncio

    from axon.server.routes.ollama import _lines

    generation = _Generation(CALL_TEXT)

    async def stream() -> list[str]:
        return [line async for line in _lines(generation, _reply())]

    lines = [ollama.ChatResponse.model_validate(json.loads(line)) for line in asyncio.run(stream())]
    whole = ollama.ChatResponse.model_validate(_reply().whole(generation.state))
    for message in (whole.message, lines[-2].message):
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert whole.message.thinking == "".join(line.message.thinking or "" for line in lines)
    assert "Paris, then." in whole.message.thinking and whole.message.content == ""
    assert lines[-1].done and lines[-1].done_reason == "stop" and lines[-1].eval_count == 4


def _in_process(api_key: str | None, registry):
    from types import SimpleNamespace

    from axon.server.app import create_app

    app = create_app(SimpleNamespace(config=SimpleNamespace(api_key=api_key), registry=registry))
    return httpx.ASGITransport(app=app)


def test_the_api_key_and_keep_alive_zero_in_process():
    """The server's key as a bearer token, refused in Ollama's shape; an empty chat with
    keep_alive 0 unloads the model (Ollama's way of unloading one)."""
    import asyncio
    from types import SimpleNamespace

    unloaded = []

    async def unload(model_id):
        unloaded.append(model_id)

    model = SimpleNamespace(id="m")
    registry = SimpleNamespace(get=lambda name: model, aliases={}, unload=unload)
    transport = _in_process("sekrit", registry)

    async def scenario():
        wrong = ollama.AsyncClient(host="http://app", transport=transport)
        right = ollama.AsyncClient(
            host="http://app", transport=transport, headers={"Authorization": "Bearer sekrit"}
        )
        with pytest.raises(ollama.ResponseError) as refused:
            await wrong.chat(model="m", messages=[])
        return refused.value, await right.chat(model="m", messages=[], keep_alive=0)

    refused, answer = asyncio.run(scenario())
    assert refused.status_code == 401 and "API key" in refused.error
    assert answer.done and answer.done_reason == "unload" and unloaded == ["m"]


def test_pull_loads_a_repo_with_its_progress_streamed_in_process():
    """A pull is the node API's load of the repo (a GGUF quant after the colon), served under
    the name pulled; the weights' bytes stream as the engine loads them."""
    import asyncio
    from types import SimpleNamespace

    from axon.server.errors import ModelNotFound

    loads, progress, read = [], {}, asyncio.Event()

    async def load(spec):
        loads.append(spec)
        if spec.quant is None:
            return  # the whole (unstreamed) pull's load: nobody reads its progress
        for loaded in (10, 20):  # each step waits until the route has read the last one
            progress[spec.served_id] = {"loaded_bytes": loaded, "total_bytes": 20}
            read.clear()
            await read.wait()

    def load_progress(served_id):
        read.set()
        return progress.get(served_id)

    def missing(name):
        raise ModelNotFound(f"model {name!r} is not loaded", param="model")

    registry = SimpleNamespace(get=missing, aliases={}, load=load, load_progress=load_progress)
    transport = _in_process(None, registry)

    async def scenario():
        client = ollama.AsyncClient(host="http://app", transport=transport)
        lines = [line async for line in await client.pull("org/tiny-GGUF:Q8_0", stream=True)]
        whole = await client.pull("org/tiny:latest")
        return lines, whole

    lines, whole = asyncio.run(scenario())
    assert lines[0].status == "pulling org/tiny-GGUF" and lines[-1].status == "success"
    assert [(p.completed, p.total) for p in lines if p.total] == [(10, 20), (20, 20)]
    assert whole.status == "success"
    assert [(s.model_id, s.quant, s.served_id) for s in loads] == [
        ("org/tiny-GGUF", "Q8_0", "org/tiny-GGUF:Q8_0"),
        ("org/tiny", None, "org/tiny:latest"),
    ]
