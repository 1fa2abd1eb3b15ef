"""`echo` with `logprobs` on /v1/completions and vLLM's `prompt_logprobs`, through the real server:
each prompt token's logprob equals the log_softmax of transformers' logits on the same tiny
checkpoint, the first token's is null; `max_tokens: 0` with `echo` answers the prompt alone. This
is what lm-eval's loglikelihood (multiple-choice) tasks send."""

from __future__ import annotations

import json

import pytest
import torch

from .conftest import MODEL_ID, WORDS

ATOL = 1e-3
PROMPT = "hello world tell me a story"
PROMPT_IDS = [3 + WORDS.index(word) for word in PROMPT.split()]  # after 3 specials


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    """transformers' log_softmax [P, V] at each position of a prompt of token ids."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()

    @torch.no_grad()
    def scores(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)

    return scores


def completion(http, **fields) -> dict:
    reply = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": PROMPT, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_echo_with_max_tokens_0_scores_the_prompt_alone(http, client, reference):
    answer = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0
    )
    (choice,) = answer.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 0
    assert choice.logprobs.tokens == PROMPT.split()
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    scores = reference(PROMPT_IDS)
    for position in range(1, len(PROMPT_IDS)):
        want = float(scores[position - 1, PROMPT_IDS[position]])
        assert abs(choice.logprobs.token_logprobs[position] - want) <= ATOL
        top = choice.logprobs.top_logprobs[position]
        best = scores[position - 1].topk(2)
        for token_id, value in zip(best.indices.tolist(), best.values.tolist()):
            name = WORDS[token_id - 3] if 3 <= token_id < 3 + len(WORDS) else f"w{token_id}"
            assert abs(top[name] - value) <= ATOL
    offsets = choice.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_echo_then_the_completion(http, reference):
    (choice,) = completion(http, echo=True, logprobs=1, max_tokens=2, temperature=0)["choices"]
    assert choice["text"].startswith(PROMPT) and len(choice["text"].split()) == 8
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 8
    assert logprobs["token_logprobs"][0] is None
    assert all(value <= 0 for value in logprobs["token_logprobs"][1:])
    (plain,) = completion(http, echo=True, max_tokens=2, temperature=0)["choices"]
    assert plain["text"] == choice["text"] and plain["logprobs"] is None


def _streamed(http, **fields) -> list[dict]:
    body = {"model": MODEL_ID, "prompt": PROMPT, "stream": True, **fields}
    with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, reply.read()
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event)["choices"][0] for event in events[:-1]]


@pytest.mark.parametrize("logprobs", [None, 1])
def test_streamed_echo_sends_the_prompt_first(http, logprobs):
    """As vLLM streams it: the first chunk's text is the prompt and the first token, its
    logprobs the prompt's and that token's; the chunks add up to the whole answer."""
    fields = {"echo": True, "max_tokens": 3, "temperature": 0, "logprobs": logprobs}
    (whole,) = completion(http, **fields)["choices"]
    chunks = _streamed(http, **fields)
    assert len(chunks) > 1 and chunks[0]["text"].startswith(PROMPT + " ")
    assert "".join(chunk["text"] for chunk in chunks) == whole["text"]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]
    if logprobs is None:
        assert all(chunk["logprobs"] is None for chunk in chunks)
        return
    assert len(chunks[0]["logprobs"]["tokens"]) == len(PROMPT_IDS) + 1

    def joined(key: str) -> list:
        return [value for chunk in chunks for value in chunk["logprobs"][key]]

    want = whole["logprobs"]
    assert joined("tokens") == want["tokens"] and joined("text_offset") == want["text_offset"]
    assert joined("token_logprobs")[0] is None
    assert joined("token_logprobs")[1:] == pytest.approx(want["token_logprobs"][1:], abs=ATOL)
    assert [top and sorted(top) for top in joined("top_logprobs")] == [
        top and sorted(top) for top in want["top_logprobs"]
    ]


def test_streamed_echo_with_max_tokens_0_is_the_prompt_alone(http):
    (chunk,) = _streamed(http, echo=True, max_tokens=0, logprobs=1)
    assert chunk["text"] == PROMPT and chunk["finish_reason"] == "length"
    assert chunk["logprobs"]["tokens"] == PROMPT.split()
    assert chunk["logprobs"]["token_logprobs"][0] is None


def test_prompt_logprobs_in_vllms_shape_and_never_from_the_prefix_cache(http, reference):
    scores = reference(PROMPT_IDS)
    for _ in range(2):  # the second finds the prompt's blocks cached: it is scored again
        (choice,) = completion(http, prompt_logprobs=3, max_tokens=1)["choices"]
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(PROMPT_IDS) and entries[0] is None
        for position, entry in enumerate(entries[1:], start=1):
            token = PROMPT_IDS[position]
            own = entry[str(token)]
            assert abs(own["logprob"] - float(scores[position - 1, token])) <= ATOL
            assert (
                own["rank"] == int((scores[position - 1] > scores[position - 1, token]).sum()) + 1
            )
            assert len(entry) in (3, 4) and own["decoded_token"] == WORDS[token - 3]


def test_token_id_prompts_in_a_batch_as_lm_eval_sends_them(http, reference):
    prompts = [PROMPT_IDS, PROMPT_IDS[:3]]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0}
    choices = completion(http, **body)["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for ids, choice in zip(prompts, choices):
        assert choice["text"] == " ".join(WORDS[t - 3] for t in ids)
        scores = reference(ids)
        got = choice["logprobs"]["token_logprobs"]
        want = [None] + [float(scores[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert got[0] is None and all(abs(a - b) <= ATOL for a, b in zip(got[1:], want[1:]))


def test_chat_prompt_logprobs(http):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hello"}]}
    reply = http.post("/v1/chat/completions", json={**body, "prompt_logprobs": 0, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    entries = reply.json()["prompt_logprobs"]
    count = http.post("/tokenize", json={"messages": body["messages"]}).json()["count"]
    assert len(entries) == count and entries[0] is None and all(len(e) == 1 for e in entries[1:])
    plain = http.post("/v1/chat/completions", json={**body, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/responses", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_refusals_name_the_field(http, path, fields, param):
    body = {"model": MODEL_ID, "max_tokens": 1, **fields}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    elif path == "/v1/responses":
        body = {"model": MODEL_ID, "input": PROMPT, **fields}
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
