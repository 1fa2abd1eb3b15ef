"""The benchmark's prompts: random ones of a controlled token count, or read from a dataset file.

Token counts come from a tokenizer: a local one (`--tokenizer PATH`, transformers' AutoTokenizer),
else the server's `/tokenize` and `/detokenize` (vLLM's and axon's shape, or llama-server's), else
none: then a prompt of N tokens is N words, which most vocabularies encode as about N tokens.

A random prompt is random common words, tokenized, cut to exactly the input length and decoded
back to text; /v1/completions gets the token ids themselves, so its prompt length is exact (chat
adds the template's tokens, as in vLLM). Each prompt draws its own words, so prompts share no
prefix the server could serve from its prefix cache.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Protocol

import httpx

from axon.bench.client import BenchPrompt

DEFAULT_DATASET_OUTPUT_LEN = 128
# Common English words: one token each in most vocabularies, so the word count is a fair guess
# of the token count when no tokenizer is available.
_WORD_TEXT = (
    "the of and to in is that it for was on are as with his they at be this from have or by one "
    "had not but what all were when we there can an your which their said if do will each about "
    "how up out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way find "
    "use may water long little very after words called just where most know get through back "
    "much before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take why "
    "things help put years different away again off went old number great tell men say small"
)
WORDS = tuple(_WORD_TEXT.split())


class TokenCounter(Protocol):
    source: str  # "tokenizer", "server" or "words": how prompt lengths were counted

    def encode(self, text: str) -> list[int] | None: ...

    def decode(self, token_ids: list[int]) -> str: ...


class WordCounter:
    """No tokenizer: `encode` returns None and a prompt's length is its word count."""

    source = "words"

    def encode(self, text: str) -> list[int] | None:
        return None

    def decode(self, token_ids: list[int]) -> str:
        raise ValueError("no tokenizer to decode with")


class LocalTokenizer:
    source = "tokenizer"

    def __init__(self, path: str):
        from transformers import AutoTokenizer  # heavy: only when --tokenizer is given

        self._tokenizer = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int] | None:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)


class ServerTokenizer:
    """The server's /tokenize and /detokenize: vLLM's shape (`prompt` -> `tokens`, `tokens` ->
    `prompt`) or llama-server's (`content` -> `tokens`, `tokens` -> `content`)."""

    source = "server"

    def __init__(self, client: httpx.Client, model: str, llama_shape: bool = False):
        self._client, self._model, self._llama_shape = client, model, llama_shape

    @classmethod
    def probe(cls, client: httpx.Client, model: str) -> ServerTokenizer | None:
        """A tokenizer on the server's routes, or None when it has none that answers."""
        for llama_shape in (False, True):
            tokenizer = cls(client, model, llama_shape)
            try:
                token_ids = tokenizer.encode("hello world")
                if token_ids:  # llama-server answers vLLM's shape with no tokens
                    tokenizer.decode(token_ids)
                    return tokenizer
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue
        return None

    def encode(self, text: str) -> list[int] | None:
        if self._llama_shape:
            body = {"content": text, "add_special": False}
        else:
            body = {"model": self._model, "prompt": text, "add_special_tokens": False}
        response = self._client.post("/tokenize", json=body)
        response.raise_for_status()
        return [int(token) for token in response.json()["tokens"]]

    def decode(self, token_ids: list[int]) -> str:
        body = {"tokens": token_ids} if self._llama_shape else {"model": self._model}
        response = self._client.post("/detokenize", json={**body, "tokens": token_ids})
        response.raise_for_status()
        return response.json()["content" if self._llama_shape else "prompt"]


def scaled_len(length: int, range_ratio: float, rng: random.Random) -> int:
    """A length uniform in [length * (1 - ratio), length * (1 + ratio)], at least 1 (vLLM's
    --random-range-ratio)."""
    low = max(1, int(length * (1 - range_ratio)))
    return rng.randint(low, max(low, int(length * (1 + range_ratio))))


def random_text(
    counter: TokenCounter, rng: random.Random, input_len: int
) -> tuple[str, list[int] | None]:
    """Random words of `input_len` tokens -> (text, its token ids; None without a tokenizer)."""
    words = rng.choices(WORDS, k=input_len + 8)
    token_ids = counter.encode(" ".join(words))
    if token_ids is None:
        return " ".join(words[:input_len]), None
    while len(token_ids) < input_len:  # a vocabulary that splits words finer than expected
        words += rng.choices(WORDS, k=input_len - len(token_ids) + 8)
        token_ids = counter.encode(" ".join(words))
    token_ids = token_ids[:input_len]
    return counter.decode(token_ids), token_ids


def random_prompts(
    counter: TokenCounter,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    send_token_ids: bool = False,
) -> list[BenchPrompt]:
    """`num_prompts` random prompts (see the module docstring); with `send_token_ids` (a
    /v1/completions run) a prompt is its token ids when a tokenizer counted them."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        length = scaled_len(input_len, range_ratio, rng)
        text, token_ids = random_text(counter, rng, length)
        prompt = token_ids if send_token_ids and token_ids is not None else text
        prompts.append(BenchPrompt(prompt, length, scaled_len(output_len, range_ratio, rng)))
    return prompts


# ---- dataset files ----------------------------------------------------------------------------


def _sharegpt_pair(record: dict) -> tuple[str, str | None] | None:
    """(first human turn, the reply after it) of a ShareGPT record; None without a human turn."""
    if not isinstance(record, dict):
        return None
    turns = [t for t in record.get("conversations") or record.get("messages") or [] if t]
    for index, turn in enumerate(turns):
        if (turn.get("from") or turn.get("role")) in ("human", "user"):
            prompt = turn.get("value") or turn.get("content")
            following = turns[index + 1] if index + 1 < len(turns) else {}
            return prompt, following.get("value") or following.get("content")
    return None


def _jsonl_record(path: Path, number: int, line: str) -> tuple[str, int | None] | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: not valid JSON: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ValueError(f'{path}:{number}: expected {{"prompt": "..."}}, got {line[:80]}')
    return record["prompt"], record.get("output_len")


def read_dataset(path: Path) -> list[tuple[str, int | str | None]]:
    """(prompt, output length: an int, the reference reply's text, or None) per record of a
    JSONL file of {"prompt": ..., "output_len": ...} or a ShareGPT JSON list."""
    text = path.read_text()
    if text.lstrip().startswith("["):
        try:
            pairs = [_sharegpt_pair(record) for record in json.loads(text)]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        records = [pair for pair in pairs if pair is not None and isinstance(pair[0], str)]
    else:
        records = [_jsonl_record(path, n, line) for n, line in enumerate(text.splitlines(), 1)]
        records = [record for record in records if record is not None]
    if not records:
        raise ValueError(f'{path}: no prompts (JSONL of {{"prompt": ...}} or ShareGPT JSON)')
    return records


def token_count(counter: TokenCounter, text: str) -> int:
    token_ids = counter.encode(text)
    return len(text.split()) if token_ids is None else len(token_ids)


def dataset_prompts(
    counter: TokenCounter,
    path: Path,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
) -> list[BenchPrompt]:
    """`num_prompts` prompts of the file, shuffled with `seed` (repeated when it has fewer).

    A request's max_tokens is `output_len` when given, else the record's `output_len`, else the
    length of the ShareGPT reply (vLLM's rule), else DEFAULT_DATASET_OUTPUT_LEN.
    """
    records = read_dataset(path)
    random.Random(seed).shuffle(records)
    prompts = []
    for index in range(num_prompts):
        text, reference = records[index % len(records)]
        if output_len is not None:
            reference = output_len
        elif isinstance(reference, str):
            reference = token_count(counter, reference)
        max_tokens = max(1, int(reference or DEFAULT_DATASET_OUTPUT_LEN))
        prompts.append(BenchPrompt(text, token_count(counter, text), max_tokens))
    return prompts
