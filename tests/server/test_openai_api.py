"""The OpenAI routes against a real `axon serve`, driven by the official `openai` client: chat,
completions and responses, streaming, `n`, logprobs, stop strings, seeds, usage in the stream."""

from __future__ import annotations

import json

import pytest

from axon.server.errors import BadRequest, ContextLengthExceeded
from axon.server.sampling import build_sampling_params
from axon.server.schemas.protocol import ChatCompletionRequest, CompletionRequest, parse_request

from .conftest import MAX_MODEL_LEN, MODEL_ID

MESSAGES = [{"role": "user", "content": "hello world"}]
PROMPT_TOKENS = 7  # <|im_start|> user hello world <|im_end|> <|im_start|> assistant
EXACT = {"ignore_eos": True}  # exactly max_tokens tokens, whatever the random model says


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, **kwargs)


def greedy_text(client, max_tokens: int = 8) -> str:
    reply = chat(client, max_tokens=max_tokens, temperature=0, extra_body=EXACT)
    return reply.choices[0].message.content


# ---- models ---------------------------------------------------------------------------------


def test_models_lists_the_loaded_model(client):
    models = client.models.list().data
    card = next(m for m in models if m.id == MODEL_ID)
    assert card.object == "model" and card.created > 0
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID


# ---- chat -----------------------------------------------------------------------------------


def test_chat_completion_shape_and_usage(client):
    reply = chat(client, max_tokens=5, temperature=0, extra_body=EXACT)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == MODEL_ID and reply.created > 0
    (choice,) = reply.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and len(choice.message.content.split()) == 5
    assert reply.usage.prompt_tokens == PROMPT_TOKENS
    assert reply.usage.completion_tokens == 5 and reply.usage.total_tokens == PROMPT_TOKENS + 5


def test_without_speculation_usage_has_no_draft_counts_and_metrics_read_zero(client, server):
    reply = chat(client, max_tokens=4, temperature=0, extra_body=EXACT)
    assert reply.usage.completion_tokens_details is None
    text = client.completions.create(model=MODEL_ID, prompt="hello", max_tokens=2).usage
    assert text.completion_tokens_details is None
    assert server.metric_line("axon:spec_decode_num_drafts_total") == 0.0
    assert server.metric_line("axon:spec_decode_num_accepted_tokens_total") == 0.0


def test_chat_stream_role_tokens_finish_usage(client):
    options = {"include_usage": True}
    stream = chat(
        client, max_tokens=6, temperature=0, stream=True, stream_options=options, extra_body=EXACT
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert len(content) == 6  # one content chunk per token
    final, usage = chunks[-2], chunks[-1]
    assert final.choices[0].finish_reason == "length" and not final.choices[0].delta.content
    assert usage.choices == [] and usage.usage.completion_tokens == 6
    assert usage.usage.prompt_tokens == PROMPT_TOKENS


def test_chat_stream_ends_with_done_and_no_usage_unless_asked(http):
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("usage" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_stream_text_equals_non_stream_text(client):
    expected = greedy_text(client, 8)
    stream = chat(client, max_tokens=8, temperature=0, stream=True, extra_body=EXACT)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == expected


def test_n_choices(client):
    reply = chat(client, max_tokens=4, n=3, temperature=1.0, seed=5, extra_body=EXACT)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens == PROMPT_TOKENS


def test_n_choices_stream(client):
    stream = chat(client, max_tokens=3, n=2, logprobs=True, stream=True, extra_body=EXACT)
    tokens, finished = {0: 0, 1: 0}, set()
    for chunk in stream:
        for choice in chunk.choices:
            tokens[choice.index] += len(choice.logprobs.content) if choice.logprobs else 0
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and tokens == {0: 3, 1: 3}


def test_chat_logprobs(client):
    reply = chat(
        client, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, extra_body=EXACT
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    assert " ".join(t.token for t in content) == reply.choices[0].message.content.strip()
    for entry in content:
        assert bytes(entry.bytes).decode() == entry.token and entry.logprob <= 0
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the best
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_chat_logprobs_stream(client):
    stream = chat(
        client, max_tokens=3, logprobs=True, top_logprobs=2, stream=True, extra_body=EXACT
    )
    entries = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 for e in entries)


def test_stop_string_cuts_the_text(client):
    full = greedy_text(client, 8)
    stop = full.split()[3]
    reply = chat(client, max_tokens=8, temperature=0, stop=[stop], extra_body=EXACT)
    assert reply.choices[0].message.content == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_stop_string_in_a_stream(client):
    full = greedy_text(client, 8)
    stop = full.split()[2]
    stream = chat(client, max_tokens=8, temperature=0, stop=stop, stream=True, extra_body=EXACT)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        kwargs = dict(max_tokens=8, temperature=1.0, top_p=1.0, seed=seed, extra_body=EXACT)
        return chat(client, **kwargs).choices[0].message.content

    assert sample(11) == sample(11)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


def test_vllm_extras_and_max_completion_tokens(client):
    extras = {"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.2, "ignore_eos": True}
    reply = chat(
        client,
        max_completion_tokens=3,
        max_tokens=9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body=extras,
    )
    assert reply.usage.completion_tokens == 3  # max_completion_tokens wins over max_tokens


def test_unknown_fields_are_ignored(http):
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 2, "not_a_field": {"x": 1}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_text_parts_content(client):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    messages = [{"role": "user", "content": parts}]
    reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=2)
    assert reply.usage.prompt_tokens == PROMPT_TOKENS


# ---- completions ----------------------------------------------------------------------------


def test_completion_shape_and_logprobs(client):
    reply = client.completions.create(
        model=MODEL_ID, prompt="tell me a story", max_tokens=4, logprobs=2, extra_body=EXACT
    )
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    (choice,) = reply.choices
    assert choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert reply.usage.prompt_tokens == 4 and reply.usage.completion_tokens == 4


def test_completion_token_prompts_batch_and_n(client):
    reply = client.completions.create(
        model=MODEL_ID, prompt=[[5, 6], [7, 8, 9]], max_tokens=3, n=2, extra_body=EXACT
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert reply.usage.prompt_tokens == 5 and reply.usage.completion_tokens == 12


def test_completion_stream_with_usage(client):
    stream = client.completions.create(
        model=MODEL_ID,
        prompt="hello",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXACT,
    )
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(text_chunks) == 5
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_completion_stream_of_several_prompts(client):
    stream = client.completions.create(
        model=MODEL_ID,
        prompt=[[5, 6], [7, 8, 9]],
        max_tokens=3,
        logprobs=0,
        n=2,
        stream=True,
        extra_body=EXACT,
    )
    tokens, finished = dict.fromkeys(range(4), 0), set()
    for chunk in stream:
        for choice in chunk.choices:
            assert len(choice.logprobs.tokens if choice.logprobs else []) <= 1
            tokens[choice.index] += len(choice.logprobs.tokens) if choice.logprobs else 0
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2, 3} and tokens == dict.fromkeys(range(4), 3)


def test_completion_stop_and_seed(client):
    def run(**kwargs):
        reply = client.completions.create(
            model=MODEL_ID, prompt="hello world", max_tokens=8, extra_body=EXACT, **kwargs
        )
        return reply.choices[0]

    full = run(temperature=0).text
    stop = full.split()[4]
    cut = run(temperature=0, stop=[stop])
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    assert run(temperature=0.9, seed=3).text == run(temperature=0.9, seed=3).text


# ---- responses ------------------------------------------------------------------------------


def test_responses_non_stream(client):
    response = client.responses.create(
        model=MODEL_ID,
        input="hello world",
        instructions="tell me a story",
        max_output_tokens=4,
        temperature=0,
        extra_body=EXACT,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete"  # max_output_tokens reached
    (item,) = response.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert len(response.output_text.split()) == 4
    assert response.usage.output_tokens == 4 and response.usage.input_tokens > PROMPT_TOKENS


def test_responses_input_items(client):
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"type": "reasoning", "summary": []},
        {"role": "assistant", "content": "world"},
        {"type": "message", "role": "user", "content": "tell me"},
    ]
    response = client.responses.create(model=MODEL_ID, input=items, max_output_tokens=2)
    assert response.status in ("completed", "incomplete")


def test_responses_stream_events(client):
    stream = client.responses.create(
        model=MODEL_ID,
        input="hello world",
        max_output_tokens=3,
        temperature=0,
        stream=True,
        extra_body=EXACT,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 3
    assert events[-4].text == "".join(deltas)
    assert events[-1].response.output[0].content[0].text == "".join(deltas)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_stream_has_named_events_and_no_done(http):
    body = {"model": MODEL_ID, "input": "hello", "max_output_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[0] == "event: response.created"
    assert "data: [DONE]" not in lines and lines[-2] == "event: response.completed"


# ---- sampling parameters (no server) --------------------------------------------------------


def _chat_request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": MESSAGES, **fields}
    return parse_request(json.dumps(body).encode(), ChatCompletionRequest)


def test_generation_config_defaults_fill_omitted_fields():
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    params = build_sampling_params(_chat_request(), 10, 100, defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 20, 0.95)
    assert params.max_tokens == 90  # omitted: up to the context length
    params = build_sampling_params(_chat_request(temperature=0, top_k=-1), 10, 100, defaults)
    assert (params.temperature, params.top_k) == (0.0, 0)
    assert build_sampling_params(_chat_request(), 10, 100).temperature == 1.0


def test_sampling_field_names_and_errors():
    params = build_sampling_params(
        _chat_request(max_tokens=50, max_completion_tokens=7, stop="x", logprobs=True), 10, 100
    )
    assert (params.max_tokens, params.stop, params.logprobs) == (7, ["x"], 0)
    with pytest.raises(BadRequest) as error:
        build_sampling_params(_chat_request(top_logprobs=30, logprobs=True), 10, 100)
    assert error.value.param == "top_logprobs"
    with pytest.raises(ContextLengthExceeded) as error:
        build_sampling_params(_chat_request(max_completion_tokens=95), 10, 100)
    assert error.value.param == "max_completion_tokens"
    completion = parse_request(b'{"model": "m", "prompt": "x"}', CompletionRequest)
    assert build_sampling_params(completion, 3, 100, prompt_field="prompt").max_tokens == 16
