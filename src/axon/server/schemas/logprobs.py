"""The `logprobs` objects of chat and legacy completions responses (re-exported by protocol.py,
where the routes import them from)."""

from __future__ import annotations


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def _ranked(entry: dict, limit: int) -> list:
    """The `limit` best alternatives of one position, best first."""
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank or 1 << 30, -item[1].logprob))
    return ranked[:limit]


def _token_text(entry: dict, token_id: int, decode) -> str:
    lp = entry.get(token_id)
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else decode(token_id)


def chat_logprobs(token_ids: list[int], entries: list[dict], top: int, decode) -> dict:
    """Chat's `logprobs` object for the tokens `token_ids` (their `entries` of token id ->
    Logprob); `decode(token_id)` names a token the entry does not."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        token = _token_text(entry, token_id, decode)
        alternatives = []
        for alt_id, alt in _ranked(entry, top):
            alt_token = _token_text(entry, alt_id, decode)
            alternatives.append(
                {"token": alt_token, "logprob": alt.logprob, "bytes": _token_bytes(alt_token)}
            )
        content.append(
            {
                "token": token,
                "logprob": entry[token_id].logprob,
                "bytes": _token_bytes(token),
                "top_logprobs": alternatives,
            }
        )
    return {"content": content}


def completion_logprobs(
    token_ids: list[int], entries: list[dict], top: int, decode, text_offset: int = 0
) -> dict:
    """The legacy completions `logprobs` object; offsets count from `text_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        token = _token_text(entry, token_id, decode)
        tokens.append(token)
        token_logprobs.append(entry[token_id].logprob)
        offsets.append(text_offset)
        text_offset += len(token)
        top_logprobs.append(
            {_token_text(entry, alt_id, decode): alt.logprob for alt_id, alt in _ranked(entry, top)}
        )
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def prompt_logprobs_json(entries: list[dict | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or token id -> {logprob,
    rank, decoded_token}, the prompt's own token and the top ones."""
    return [
        None
        if entry is None
        else {
            str(token_id): {
                "logprob": lp.logprob,
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]


def echo_logprobs(prompt_ids: list[int], entries: list[dict | None], top: int, decode) -> dict:
    """The legacy completions `logprobs` object of an echoed prompt: its first token has no
    logprob (null, as OpenAI's), the others theirs under the prompt before them."""
    first = decode(prompt_ids[0])
    rest = completion_logprobs(prompt_ids[1:], entries[1:], top, decode, len(first))
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }
