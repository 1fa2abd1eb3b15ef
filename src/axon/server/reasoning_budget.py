"""Reasoning budgets: a request's `thinking_token_budget` (vLLM), `reasoning_effort` (OpenAI) or
`thinking.budget_tokens` (Anthropic) -> the engine's budget fields.

The marker token ids come from the tokenizer here, in the HTTP process, so the engine needs no
tokenizer. An effort is a budget from the model's `reasoning_effort_budgets` (a per-model
setting, DEFAULT_EFFORT_BUDGETS unless set); `none` / `minimal` turn thinking off through the
template's `enable_thinking`, and are a 400 for a template that cannot. A template that reads
`reasoning_effort` itself (gpt-oss, Hy3, Command A) gets it as a template variable too.
"""

from __future__ import annotations

from axon.server.errors import BadRequest
from axon.tokenizer.parsers import parser_family, prompt_opens_reasoning
from axon.tokenizer.parsers.reasoning import THINK_END, THINK_START

DEFAULT_EFFORT_BUDGETS = {"low": 512, "medium": 2048, "high": 8192}
EFFORTS_OFF = ("none", "minimal")
# Room kept for the answer after a forced end of thinking, at most a quarter of max_tokens.
DEFAULT_ANSWER_RESERVE_TOKENS = 64


def _template(model) -> str:
    template = getattr(model.tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else str(template)


def _family(model):
    info = getattr(getattr(model, "client", None), "info", None) or {}
    return parser_family(model.tokenizer, info.get("model_type"))


def effort_budgets(model) -> dict[str, int]:
    """The model's effort -> thinking budget mapping (its spec's, else the defaults)."""
    configured = getattr(getattr(model, "spec", None), "reasoning_effort_budgets", None)
    return dict(configured or DEFAULT_EFFORT_BUDGETS)


def can_disable_thinking(model) -> bool:
    return "enable_thinking" in _template(model)


def supported_efforts(model) -> list[str]:
    """The reasoning_effort values this model takes (what /v1/models lists): the budgets'
    efforts when it has thinking markers, those of a template that reads `reasoning_effort`,
    and `none` / `minimal` when its template can turn thinking off."""
    efforts: list[str] = []
    if _family(model).reasoning or "reasoning_effort" in _template(model):
        efforts += list(effort_budgets(model))
    if efforts and can_disable_thinking(model):
        efforts += list(EFFORTS_OFF)
    return efforts


def with_reasoning_effort(model, body):
    """`body` (a chat request) with its reasoning_effort made a thinking budget and template
    variables; raises BadRequest for an effort the model does not take."""
    effort = getattr(body, "reasoning_effort", None)
    if effort is None:
        return body
    if effort not in supported_efforts(model):
        takes = supported_efforts(model) or "no reasoning_effort"
        message = f"reasoning_effort {effort!r} is not supported by this model (it takes {takes})"
        raise BadRequest(message, param="reasoning_effort")
    kwargs = dict(body.chat_template_kwargs or {})
    if "reasoning_effort" in _template(model):
        kwargs.setdefault("reasoning_effort", effort)
    update = {"chat_template_kwargs": kwargs}
    if effort in EFFORTS_OFF:
        kwargs.setdefault("enable_thinking", False)
    elif body.thinking_token_budget is None and _family(model).reasoning:
        update["thinking_token_budget"] = effort_budgets(model)[effort]
    return body.model_copy(update=update)


def completion_thinking_fields(model, budget: int | None, prompts: list) -> dict:
    """thinking_fields of a /v1/completions request's (text, ids) `prompts`, which share their
    sampling params: they must all end inside thinking (`…<think>`), or none of them."""
    if budget is None:
        return {}
    # The tail is enough to see a closing `<think>`, and cheap to decode.
    tails = [
        text if text is not None else model.tokenizer.decode(ids[-8:]) for text, ids in prompts
    ]
    opened = {prompt_opens_reasoning(tail) for tail in tails}
    if len(opened) > 1:
        message = (
            "thinking_token_budget: the prompts must all open thinking (end in <think>) or none"
        )
        raise BadRequest(message, param="thinking_token_budget")
    return thinking_fields(
        model, budget, THINK_START if opened.pop() else None, "thinking_token_budget"
    )


def thinking_fields(model, budget: int | None, prompt: str | None, param: str) -> dict:
    """The SamplingParams fields of a thinking `budget` on a rendered `prompt` ({} for none);
    raises BadRequest (naming `param`) for a model without single-token thinking markers."""
    if budget is None:
        return {}
    if not _family(model).reasoning:
        message = f"{param}: this model has no thinking markers (<think>, </think>) to budget"
        raise BadRequest(message, param=param)
    vocab = model.tokenizer.get_vocab()
    end_ids = [vocab[THINK_END]]
    if "</think>\\n\\n" in _template(model):  # Qwen's templates close thinking so: keep to it
        end_ids += model.tokenizer.encode("\n\n", add_special_tokens=False)
    return {
        "thinking_token_budget": budget,
        "thinking_start_token_id": vocab[THINK_START],
        "thinking_end_token_ids": end_ids,
        "thinking_in_prompt": prompt_opens_reasoning(prompt),
        "answer_reserve_tokens": DEFAULT_ANSWER_RESERVE_TOKENS,
    }
