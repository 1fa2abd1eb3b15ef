"""Every error comes back in OpenAI's envelope with the right status, driven by httpx: malformed
JSON, wrong types, unknown model, prompts too long, overload (429 + Retry-After), and a client
that goes away mid-request (its sequence aborted, its KV blocks freed)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from .conftest import MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_WAITING_REQUESTS, MODEL_ID

MESSAGES = [{"role": "user", "content": "hello world"}]
CHAT = "/v1/chat/completions"
LONG = {"max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True}  # runs for seconds


def chat_body(**fields) -> dict:
    return {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 2, **fields}


def assert_error(response: httpx.Response, status: int, code=None, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code", "param"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/responses"])
def test_malformed_json_is_400(http, path):
    response = http.post(path, content=b'{"model": ', headers={"content-type": "application/json"})
    assert assert_error(response, 400)["type"] == "invalid_request_error"
    assert_error(http.post(path, content=b""), 400)
    assert_error(http.post(path, json=[1, 2]), 400)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"n": "2"}, "n"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"stop": [1, 2]}, "stop"),
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role"),
        ({"model": 7}, "model"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
    ],
)
def test_wrong_types_are_400_naming_the_field(http, fields, param):
    assert_error(http.post(CHAT, json=chat_body(**fields)), 400, param=param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"presence_penalty": 9}, "presence_penalty"),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_out_of_range_values_are_400(http, fields, param):
    assert_error(http.post(CHAT, json=chat_body(**fields)), 400, param=param)


def test_missing_model_field_is_400(http):
    assert_error(http.post(CHAT, json={"messages": MESSAGES}), 400, param="model")


def test_completions_bad_prompts(http):
    body = {"model": MODEL_ID, "max_tokens": 2}
    assert_error(http.post("/v1/completions", json={**body, "prompt": []}), 400, param="prompt")
    bad_ids = {**body, "prompt": [1, -5]}
    assert_error(http.post("/v1/completions", json=bad_ids), 400, param="prompt")
    huge_id = {**body, "prompt": [10**9]}
    assert_error(http.post("/v1/completions", json=huge_id), 400, param="prompt")
    assert_error(http.post("/v1/completions", json={**body, "prompt": {"x": 1}}), 400)


def test_unknown_model_is_404(http):
    for path, body in [
        (CHAT, chat_body(model="nope")),
        ("/v1/completions", {"model": "nope", "prompt": "hello"}),
        ("/v1/responses", {"model": "nope", "input": "hello"}),
    ]:
        error = assert_error(http.post(path, json=body), 404, code="model_not_found")
        assert error["type"] == "not_found_error"
    assert_error(http.get("/v1/models/nope"), 404, code="model_not_found")


def test_unknown_route_is_enveloped(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get(CHAT), 405)


def test_prompt_too_long_is_context_length_exceeded(http):
    long_text = "hello " * (MAX_MODEL_LEN + 10)
    messages = [{"role": "user", "content": long_text}]
    response = http.post(CHAT, json=chat_body(messages=messages))
    assert_error(response, 400, code="context_length_exceeded", param="messages")
    response = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": long_text})
    assert_error(response, 400, code="context_length_exceeded", param="prompt")
    response = http.post(CHAT, json=chat_body(messages=messages, stream=True))
    assert_error(response, 400, code="context_length_exceeded")


def test_prompt_plus_max_tokens_too_long(http):
    response = http.post(CHAT, json=chat_body(max_tokens=MAX_MODEL_LEN))
    assert_error(response, 400, code="context_length_exceeded", param="max_tokens")
    body = {"model": MODEL_ID, "input": "hello", "max_output_tokens": MAX_MODEL_LEN}
    response = http.post("/v1/responses", json=body)
    assert_error(response, 400, code="context_length_exceeded", param="max_output_tokens")


def test_previous_response_id_is_refused(http):
    body = {"model": MODEL_ID, "input": "hello", "previous_response_id": "resp_123"}
    response = http.post("/v1/responses", json=body)
    assert_error(response, 400, code="chained_conversation_not_supported")


def test_bad_responses_items_are_400(http):
    body = {"model": MODEL_ID, "input": [{"type": "computer_call"}]}
    assert_error(http.post("/v1/responses", json=body), 400, param="input[0].type")
    body = {"model": MODEL_ID, "input": [{"role": "user", "content": [1, 2]}]}
    assert_error(http.post("/v1/responses", json=body), 400, param="input[0].content")
    body = {"model": MODEL_ID, "input": [{"role": 5, "content": "hello"}]}
    assert_error(http.post("/v1/responses", json=body), 400, param="input")
    body = {"model": MODEL_ID, "input": "hello", "max_output_tokens": "many"}
    assert_error(http.post("/v1/responses", json=body), 400, param="max_output_tokens")


# ---- hostile and unsupported input: 400s before any work ----------------------------------

RESPONSES = "/v1/responses"
COMPLETIONS = "/v1/completions"
NAMELESS_TOOL = {"tools": [{"type": "function"}], "tool_choice": "required"}


def responses_body(**fields) -> dict:
    return {"model": MODEL_ID, "input": "hello", "max_output_tokens": 2, **fields}


def raw_json(body: dict, **raw_fields: str) -> bytes:
    """`body` as JSON with `raw_fields` spliced in verbatim (NaN, Infinity: not Python's JSON)."""
    text = json.dumps(body)[:-1]
    return (text + "".join(f', "{k}": {v}' for k, v in raw_fields.items()) + "}").encode()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, chat_body(**NAMELESS_TOOL), "tools[0].function"),
        (RESPONSES, responses_body(**NAMELESS_TOOL), "tools[0].name"),
        (RESPONSES, responses_body(tools=[{"type": "web_search"}]), "tools[0].type"),
        (CHAT, chat_body(tool_choice={"type": "function", "function": "x"}), "tool_choice"),
        (
            CHAT,
            chat_body(response_format={"type": "json_schema", "json_schema": "x"}),
            "response_format.json_schema",
        ),
        (RESPONSES, raw_json(responses_body(), temperature="Infinity"), "temperature"),
        (CHAT, raw_json(chat_body(), top_p="NaN"), "top_p"),
        (
            RESPONSES,
            raw_json(
                responses_body(),
                tools='[{"type": "function", "name": "f", "parameters": {"x": -Infinity}}]',
            ),
            "tools[0].parameters.x",
        ),
    ],
)
def test_former_500s_are_400s_naming_the_field(http, path, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    assert_error(http.post(path, content=content, headers=headers), 400, param=param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 129}, "n"),
        ({"n": 1e30}, "n"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": "x" * 1001}, "stop"),
        ({"stop_token_ids": list(range(129))}, "stop_token_ids"),
        ({"seed": 2**64}, "seed"),
        ({"logit_bias": {"hello": 1}}, "logit_bias.hello"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {"256": 1}}, "logit_bias"),  # the tiny vocabulary is 256 tokens
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 129}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f" * 300_000}}]}, "tools"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"a": "b" * 70_000}},
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_unbounded_work_is_refused(http, fields, param):
    assert_error(http.post(CHAT, json=chat_body(**fields)), 400, param=param)


def test_completions_bounds_and_empty_prompts(http):
    body = {"model": MODEL_ID, "max_tokens": 2}
    for fields, param in [
        ({"prompt": "hello", "best_of": 3}, "best_of"),
        ({"prompt": "hello", "logprobs": 21}, "logprobs"),
        ({"prompt": ""}, "prompt"),  # this tokenizer adds no BOS: no tokens at all
        ({"prompt": ["hello", ""]}, "prompt"),
    ]:
        assert_error(http.post(COMPLETIONS, json={**body, **fields}), 400, param=param)


def test_image_and_unknown_content_parts_are_refused(http):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    text = {"type": "text", "text": "hello"}
    messages = [{"role": "user", "content": [text, image]}]
    response = http.post(CHAT, json=chat_body(messages=messages))
    assert_error(response, 400, code="vision_unsupported", param="messages[0].content[1]")
    messages = [{"role": "user", "content": [{"type": "input_audio"}]}]
    assert_error(
        http.post(CHAT, json=chat_body(messages=messages)), 400, param="messages[0].content[0].type"
    )
    item = {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
    response = http.post(RESPONSES, json=responses_body(input=[item]))
    assert_error(response, 400, code="vision_unsupported", param="input[0].content[0]")
    item = {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}
    response = http.post(RESPONSES, json=responses_body(input=[item]))
    assert_error(response, 400, param="input[0].content[0].type")


def test_logit_bias_moves_the_greedy_token(http):
    body = {"model": MODEL_ID, "prompt": "hello world", "max_tokens": 1, "temperature": 0}
    plain = http.post(COMPLETIONS, json=body).json()["choices"][0]["text"].strip()
    target = "w200" if plain != "w200" else "w201"
    biased = http.post(COMPLETIONS, json={**body, "logit_bias": {target[1:]: 100}})
    assert biased.json()["choices"][0]["text"].strip() == target


def test_kv_cache_memory_beyond_the_host_is_refused():
    from pydantic import ValidationError

    from axon.server.schemas.node_protocol import ModelSpec

    assert ModelSpec(model_id="m", kv_cache_memory="64M").kv_cache_memory == 64 << 20
    with pytest.raises(ValidationError) as raised:
        ModelSpec(model_id="m", kv_cache_memory=10**15)
    assert raised.value.errors()[0]["loc"] == ("kv_cache_memory",)


# ---- the engine side: overload and disconnects --------------------------------------------


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def assert_engine_idle(server) -> None:
    """No request runs or waits in the engine, and every KV block is free again."""
    wait_until(
        lambda: (
            server.metric("axon:num_requests_running") == 0
            and server.metric("axon:num_requests_waiting") == 0
            and server.metric("axon:kv_cache_usage_perc") == 0
        )
    )


async def _hold_streams(server, count: int) -> tuple[list, httpx.Response]:
    """Opens `count` long streams, then one more request; returns the tasks and its answer."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:

        async def hold() -> None:
            async with client.stream("POST", CHAT, json=chat_body(stream=True, **LONG)) as r:
                assert r.status_code == 200
                await asyncio.sleep(60)

        tasks = [asyncio.create_task(hold()) for _ in range(count)]
        await asyncio.sleep(1.0)  # all of them admitted (two running, the rest queued)
        assert not any(task.done() for task in tasks)
        started = time.monotonic()
        refused = await client.post(CHAT, json=chat_body())
        refused.elapsed_s = time.monotonic() - started
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return tasks, refused


def test_overload_is_429_with_retry_after_at_once(server):
    assert_engine_idle(server)
    _, refused = asyncio.run(_hold_streams(server, MAX_NUM_SEQS + MAX_WAITING_REQUESTS))
    assert_error(refused, 429, code="too_many_requests")
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.elapsed_s < 2.0
    assert_engine_idle(server)  # the held streams were aborted when their clients left
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.post(CHAT, json=chat_body()).status_code == 200


def test_disconnect_mid_stream_frees_blocks(server):
    assert_engine_idle(server)
    aborted = server.metric("axon:request_success_total", finished_reason="abort")
    generated = server.metric("axon:generation_tokens_total")
    with (
        httpx.Client(base_url=server.base_url, timeout=60) as http,
        http.stream("POST", CHAT, json=chat_body(stream=True, **LONG)) as response,
    ):
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)]  # a few tokens in: the sequence holds blocks
        assert server.metric("axon:kv_cache_usage_perc") > 0
    assert_engine_idle(server)
    assert server.metric("axon:request_success_total", finished_reason="abort") == aborted + 1
    assert server.metric("axon:generation_tokens_total") - generated < LONG["max_tokens"]


def test_disconnect_while_waiting_for_a_non_streaming_answer(server):
    assert_engine_idle(server)
    aborted = server.metric("axon:request_success_total", finished_reason="abort")
    with (
        httpx.Client(base_url=server.base_url, timeout=0.5) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        http.post(CHAT, json=chat_body(**LONG))
    assert_engine_idle(server)
    assert server.metric("axon:request_success_total", finished_reason="abort") == aborted + 1


def test_a_loading_model_is_503_with_retry_after(server, tiny_chat_model):
    """While a second copy of the model loads, requests for it get 503, then 200 once loaded."""
    loading_id = "tiny-loading"
    spec = {"model_id": str(tiny_chat_model), "served_model_name": loading_id}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:

        async def scenario() -> httpx.Response:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
                load = asyncio.create_task(client.post("/models/load", json=spec))
                while True:  # until the registry knows the model (404 before that)
                    response = await client.post(CHAT, json=chat_body(model=loading_id))
                    if response.status_code != 404 or load.done():
                        break
                assert (await load).status_code == 200
                return response

        loading = asyncio.run(scenario())
        try:
            assert_error(loading, 503, code="model_unavailable")
            assert int(loading.headers["retry-after"]) >= 1
            assert http.post(CHAT, json=chat_body(model=loading_id)).status_code == 200
        finally:
            http.post("/models/unload", json={"model_id": loading_id})


def test_app_envelopes_framework_errors_and_crashes():
    """FastAPI's own validation errors become 400s naming the field; a crash is a 500 envelope."""
    from types import SimpleNamespace

    from axon.server.app import create_app

    class CrashingRegistry:
        def get(self, model_id):
            raise RuntimeError("boom")

    state = SimpleNamespace(config=SimpleNamespace(api_key=None), registry=CrashingRegistry())
    app = create_app(state)

    @app.get("/typed")
    async def typed(count: int) -> dict:
        return {"count": count}

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            typed_response = await client.get("/typed", params={"count": "many"})
            crash = await client.post(CHAT, json=chat_body())
            return typed_response, crash

    typed_response, crash = asyncio.run(scenario())
    assert_error(typed_response, 400, param="count")
    assert assert_error(crash, 500, code="internal_error")["type"] == "internal_error"


def test_v1_routes_require_the_api_key_when_one_is_set():
    from types import SimpleNamespace

    from axon.server.app import create_app

    registry = SimpleNamespace(list_models=lambda: [])
    app = create_app(SimpleNamespace(config=SimpleNamespace(api_key="sekrit"), registry=registry))

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return [
                await client.get("/v1/models"),
                await client.post(CHAT, json=chat_body()),
                await client.get("/v1/models", headers={"Authorization": "Bearer sekrit"}),
            ]

    no_key, no_key_chat, with_key = asyncio.run(scenario())
    assert_error(no_key, 401, code="invalid_api_key")
    assert_error(no_key_chat, 401, code="invalid_api_key")
    assert with_key.status_code == 200 and with_key.json() == {"object": "list", "data": []}
