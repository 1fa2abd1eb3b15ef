"""/v1/responses `text.format` (json_schema, json_object, text) is enforced while decoding, as
chat's `response_format` is: the official client's `responses.parse(text_format=Model)` gets
its model back from a random-weight tiny model, streamed and not; bad formats are 400s."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from .conftest import MODEL_ID

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


def test_parse_returns_the_model(byte_client):
    response = byte_client.responses.parse(
        model=MODEL_ID,
        input="weather?",
        text_format=Forecast,
        max_output_tokens=1000,
        extra_body={"seed": 1, **NO_THINKING},
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Forecast)
    assert response.text.format.type == "json_schema"


def test_streamed_parse_returns_the_model(byte_client):
    with byte_client.responses.stream(
        model=MODEL_ID,
        input="weather?",
        text_format=Forecast,
        max_output_tokens=1000,
        extra_body={"seed": 2, **NO_THINKING},
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Forecast)
    assert Forecast.model_validate_json("".join(deltas)) == final.output_parsed


def test_json_object(byte_client):
    response = byte_client.responses.create(
        model=MODEL_ID,
        input="hello",
        text={"format": {"type": "json_object"}},
        max_output_tokens=1500,
        extra_body={"seed": 3, **NO_THINKING},
    )
    assert response.status == "completed"
    assert isinstance(json.loads(response.output_text), dict)


def test_text_format_text_is_free_text(byte_client):
    response = byte_client.responses.create(
        model=MODEL_ID, input="hello", text={"format": {"type": "text"}}, max_output_tokens=2
    )
    assert response.text.format.type == "text"


@pytest.mark.parametrize(
    ("text", "param"),
    [
        (
            {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}},
            "text.format",
        ),
        ({"format": {"type": "json_schema", "name": "x", "schema": []}}, "text.format.schema"),
        ({"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
        ({"format": {"type": "yaml"}}, "text.format.type"),
        ({"format": {"type": "json_schema", "name": 3, "schema": {}}}, "text.format.name"),
        ({"format": {"type": "text"}, "verbosity": "low"}, "text.verbosity"),
        ({"format": {"type": "text"}, "colour": "red"}, "text.colour"),
    ],
)
def test_bad_text_format_is_a_400_naming_it(byte_client, text, param):
    with pytest.raises(openai.BadRequestError) as caught:
        byte_client.responses.create(model=MODEL_ID, input="hello", text=text, max_output_tokens=2)
    assert caught.value.body["param"] == param
