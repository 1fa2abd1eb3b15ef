"""Admission by size: how big one request may be at all, checked before any of its prompts is
tokenized or any of its sequences is made, whether the model is idle or busy. How busy the
model is (the 429) is ServedModel.check_capacity's business; this is the 400 for a request no
amount of waiting would make acceptable.

Two caps, per request, each with a default derived from the model:

- `max_sequences_per_request`: prompts × n (best_of equals n), or an embedding request's
  inputs. Default: 4 × the model's `max_num_seqs`, and at least OpenAI's own limits: 128 (its
  largest `n`, so any one prompt with a valid `n` fits), 2,048 inputs for an embedding model
  (prefill only, no cache kept). A request beyond a few batches' worth only queues behind
  itself; vLLM has no such cap (its queue holds every request), which is how 20,000 prompts ×
  n=128 took a model down.
- `max_output_entries_per_request`: the worst case of what the answer holds, one entry for each
  token that may be generated and one for each logprob alternative sent with it, plus the
  prompt's tokens and alternatives when prompt logprobs are asked for:
  sequences × max_tokens × (1 + top_logprobs) + prompt tokens × (1 + prompt_logprobs).
  Default: 2**21 (about 140 MB of JSON at some 70 bytes an entry with logprobs), and at least
  21 × the context, so one sequence asking for everything (max_tokens up to the context,
  top_logprobs and prompt_logprobs 20) always fits; the cap bites on what multiplies it.

`check_request` runs on the request as sent, before tokenizing (an unset max_tokens is left to
the second check); `check_params` runs on the tokenized prompts and the final SamplingParams,
before anything reaches the engine, and counts exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from axon.server.errors import BadRequest

SEQUENCES = "max_sequences_per_request"
OUTPUT_ENTRIES = "max_output_entries_per_request"
_SEQS_PER_BATCH = 4  # the default sequence cap, in the model's max_num_seqs
_MIN_SEQUENCES = {"generate": 128, "embed": 2048}  # OpenAI's largest n; its most inputs
_MIN_OUTPUT_ENTRIES = 1 << 21
_WIDEST_ENTRY = 21  # a token with top_logprobs 20


@dataclass(frozen=True)
class RequestCaps:
    """The size caps of one served model's requests."""

    model_id: str
    max_sequences: int
    max_output_entries: int

    @classmethod
    def of(cls, model, server_config) -> RequestCaps:
        """The caps the server config sets, else the defaults derived from `model` (a
        ServedModel: its id, task, max_num_seqs and max_model_len)."""
        sequences = getattr(server_config, SEQUENCES, None)
        entries = getattr(server_config, OUTPUT_ENTRIES, None)
        if sequences is None:
            least = _MIN_SEQUENCES.get(model.task, _MIN_SEQUENCES["generate"])
            sequences = max(_SEQS_PER_BATCH * model.max_num_seqs, least)
        if entries is None:
            entries = max(_MIN_OUTPUT_ENTRIES, _WIDEST_ENTRY * model.max_model_len)
        return cls(model.id, sequences, entries)

    def check_sequences(self, num_prompts: int, n: int = 1, prompts_param: str = "prompt") -> int:
        """Returns the request's sequences (num_prompts × n); raises BadRequest beyond the cap,
        naming `n` for one prompt, else `prompts_param` (the field that holds the prompts)."""
        total = num_prompts * n
        if total <= self.max_sequences:
            return total
        shape = [f"{num_prompts} {prompts_param}s"] if num_prompts > 1 else []
        shape += [f"n={n}"] if n > 1 or num_prompts == 1 else []
        raise BadRequest(
            f"this request asks for {total} sequences ({' × '.join(shape)}); a request to "
            f"model {self.model_id!r} may have at most {self.max_sequences} ({SEQUENCES}): "
            f"send fewer {prompts_param}s" + (" or a lower n" if n > 1 else ""),
            code=SEQUENCES,
            param="n" if num_prompts == 1 else prompts_param,
        )

    def check_entries(
        self,
        sequences: int,
        max_tokens: int,
        top_logprobs: int | None,
        prompt_entries: int = 0,
        param: str = "max_tokens",
    ) -> None:
        """Raises BadRequest when `sequences` × `max_tokens` × (1 + top_logprobs), plus
        `prompt_entries`, is beyond the output-entries cap."""
        width = 1 + (top_logprobs or 0)
        total = sequences * max_tokens * width + prompt_entries
        if total <= self.max_output_entries:
            return
        prompts = f" + {prompt_entries} of prompt logprobs" if prompt_entries else ""
        raise BadRequest(
            f"this request may produce {total} output entries ({sequences} sequences × "
            f"{param} {max_tokens} × (1 + top_logprobs {top_logprobs or 0}){prompts}); a "
            f"request to model {self.model_id!r} may produce at most "
            f"{self.max_output_entries} ({OUTPUT_ENTRIES}): lower {param}, n or top_logprobs",
            code=OUTPUT_ENTRIES,
            param=param,
        )

    def check_params(self, prompt_lens: list[int], params, param: str = "max_tokens") -> None:
        """Both caps, exactly, for prompts of `prompt_lens` tokens sampled with `params`
        (SamplingParams, max_tokens resolved)."""
        sequences = self.check_sequences(len(prompt_lens), params.n)
        prompt_entries = 0
        if params.prompt_logprobs is not None:
            prompt_entries = sum(prompt_lens) * (1 + params.prompt_logprobs)
        max_tokens = params.max_tokens or 1
        self.check_entries(sequences, max_tokens, params.logprobs, prompt_entries, param)


def check_request(model, body, num_prompts: int = 1) -> None:
    """Both caps on an OpenAI request as sent (a SamplingRequest of `num_prompts` prompts),
    before anything of it is tokenized. An unset max_tokens is counted by `check_params`;
    one beyond the context counts as the context (the context check refuses it later)."""
    caps: RequestCaps = model.size_caps
    sequences = caps.check_sequences(num_prompts, body.requested_n())
    max_tokens, max_field = body.requested_max_tokens()
    top_logprobs, _ = body.requested_logprobs()
    if max_tokens is not None and max_tokens > 0:
        max_tokens = min(max_tokens, model.max_model_len - 1)
        caps.check_entries(sequences, max_tokens, top_logprobs, param=max_field)
