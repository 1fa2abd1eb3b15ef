"""Model aliases: `--served-model-name ID ALIAS...` and the config file's `[model_aliases]`, so
that a client that insists on its own model name (Claude Code sends "claude-sonnet-4-5")
reaches a served model. Requests by alias on the OpenAI, Anthropic and node routes of a real
`axon serve`, answered under the name sent; `/v1/models` lists each alias after its model."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from axon.cli import build_parser
from axon.server.config import ServerConfig, config_from_mapping, load_config
from axon.server.schemas.node_protocol import ModelSpec
from axon.server.serve_args import config_from_namespace

from .conftest import (
    MODEL_ID,
    _serve_args,
    _server_env,
    _wait_until_serving,
    spawn_serve,
    stop_server,
)

CLAUDE = "claude-sonnet-4-5"  # an alias from the command line
GPT = "gpt-4o"  # an alias from the config file
HELLO = [{"role": "user", "content": "hello world"}]


# ---- the command line and the config file --------------------------------------------------


def test_served_model_name_takes_aliases(tmp_path):
    config_file = tmp_path / "axon.toml"
    config_file.write_text(f'[model_aliases]\n"{GPT}" = "tiny"\n')
    argv = ["serve", "/models/x", "-c", str(config_file), "--served-model-name", "tiny", CLAUDE]
    config = config_from_namespace(build_parser().parse_args(argv), environ={})
    assert [spec.served_id for spec in config.default_models] == ["tiny"]
    assert config.model_aliases == {GPT: "tiny", CLAUDE: "tiny"}
    config.check_model_aliases()
    one = build_parser().parse_args(["serve", "/models/x", "--served-model-name", "tiny"])
    assert config_from_namespace(one, environ={}).model_aliases == {}
    with pytest.raises(SystemExit):  # an empty name is refused as before
        build_parser().parse_args(["serve", "/models/x", "--served-model-name", "tiny", ""])


def test_model_aliases_in_the_config_file_and_environment(tmp_path):
    config_file = tmp_path / "axon.toml"
    config_file.write_text('[model_aliases]\n"claude-opus-4" = "qwen"\n')
    assert load_config(config_file, environ={}).model_aliases == {"claude-opus-4": "qwen"}
    environ = {"AXON_MODEL_ALIASES": '{ "o3" = "qwen" }'}
    assert load_config(None, environ=environ).model_aliases == {"o3": "qwen"}
    for bad in ({"a": 1}, ["a"], {"": "m"}):
        with pytest.raises(ValueError, match="model_aliases"):
            config_from_mapping({"model_aliases": bad})


def test_an_alias_must_name_a_startup_model_and_be_no_models_id():
    models = (ModelSpec(model_id="org/a"), ModelSpec(model_id="/b", served_model_name="b"))
    aliases = {"x": "b", "y": "org/a"}
    ServerConfig(default_models=models, model_aliases=aliases).check_model_aliases()
    with pytest.raises(ValueError, match="'x' names 'nope'"):
        ServerConfig(default_models=models, model_aliases={"x": "nope"}).check_model_aliases()
    with pytest.raises(ValueError, match="'b' is a served model's own id"):
        ServerConfig(default_models=models, model_aliases={"b": "org/a"}).check_model_aliases()
    with pytest.raises(ValueError, match="'z' names 'y'"):  # no alias of an alias
        aliases = {"y": "b", "z": "y"}
        ServerConfig(default_models=models, model_aliases=aliases).check_model_aliases()


def test_an_alias_naming_no_model_stops_axon_serve(tiny_chat_model, tmp_path):
    config_file = tmp_path / "axon.toml"
    config_file.write_text('[model_aliases]\n"claude-haiku-4-5" = "not-served"\n')
    args = [*_serve_args(tiny_chat_model), "-c", str(config_file)]
    done = subprocess.run(
        [sys.executable, "-m", "axon", "serve", *args],
        env=_server_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "'claude-haiku-4-5' names 'not-served'" in done.stderr


# ---- requests by alias through a real server -------------------------------------------------


@pytest.fixture(scope="module")
def alias_server(tiny_chat_model, tmp_path_factory):
    config_file = tmp_path_factory.mktemp("aliases") / "axon.toml"
    config_file.write_text(f'[model_aliases]\n"{GPT}" = "{MODEL_ID}"\n')
    args = _serve_args(tiny_chat_model)
    args.insert(args.index(MODEL_ID) + 1, CLAUDE)
    env = {"AXON_ALLOWED_LOCAL_MODEL_PATHS": str(tiny_chat_model)}
    running = spawn_serve([*args, "-c", str(config_file)], env)
    try:
        _wait_until_serving(running)
        yield running
    finally:
        stop_server(running)


@pytest.fixture()
def alias_http(alias_server):
    with httpx.Client(base_url=alias_server.base_url, timeout=60) as c:
        yield c


def test_models_lists_each_alias_after_its_model(alias_http):
    cards = alias_http.get("/v1/models").json()["data"]
    assert [card["id"] for card in cards] == [MODEL_ID, GPT, CLAUDE]  # the file, then flags
    assert "parent" not in cards[0]
    for card in cards[1:]:
        assert card["parent"] == MODEL_ID and card["root"] == cards[0]["root"]
        assert card["max_model_len"] == cards[0]["max_model_len"]
    one = alias_http.get(f"/v1/models/{CLAUDE}").json()
    assert one["id"] == CLAUDE and one["parent"] == MODEL_ID
    assert [info["id"] for info in alias_http.get("/models").json()] == [MODEL_ID]


@pytest.mark.parametrize("name", [CLAUDE, GPT])
def test_openai_routes_by_alias_echo_the_name(alias_server, name):
    from openai import OpenAI

    url = alias_server.openai_url
    with OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
        chat = client.chat.completions.create(
            model=name, messages=HELLO, max_tokens=4, temperature=0
        )
        expected = client.chat.completions.create(
            model=MODEL_ID, messages=HELLO, max_tokens=4, temperature=0
        )
        assert chat.model == name and expected.model == MODEL_ID
        assert chat.choices[0].message.content == expected.choices[0].message.content
        stream = client.chat.completions.create(
            model=name, messages=HELLO, max_tokens=2, stream=True
        )
        assert {chunk.model for chunk in stream} == {name}
        completion = client.completions.create(model=name, prompt="hello", max_tokens=3)
        assert completion.model == name and len(completion.choices) == 1
        stream = client.completions.create(model=name, prompt="hi", max_tokens=2, stream=True)
        assert {chunk.model for chunk in stream} == {name}


def test_anthropic_messages_by_alias_echo_the_name(alias_server):
    anthropic = pytest.importorskip("anthropic")
    url = alias_server.base_url
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as claude:
        message = claude.messages.create(model=CLAUDE, messages=HELLO, max_tokens=4)
        assert message.model == CLAUDE and message.content[0].type == "text"
        with claude.messages.stream(model=CLAUDE, messages=HELLO, max_tokens=2) as stream:
            assert stream.get_final_message().model == CLAUDE
        counted = claude.messages.count_tokens(model=CLAUDE, messages=HELLO)
        assert (
            counted.input_tokens
            == claude.messages.count_tokens(model=MODEL_ID, messages=HELLO).input_tokens
        )
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.create(model="claude-opus-4-1", messages=HELLO, max_tokens=4)


def test_node_routes_resolve_aliases(alias_http, tiny_chat_model):
    assert alias_http.get(f"/models/{CLAUDE}/endpoint").status_code == 200
    assert alias_http.get("/models/claude-opus-4-1/endpoint").status_code == 404
    spec = {"model_id": str(tiny_chat_model), "served_model_name": GPT, "max_model_len": 64}
    refused = alias_http.post("/models/load", json=spec)  # an alias is no model's id
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "served_model_name"
    assert f"{GPT!r} is an alias of {MODEL_ID!r}" in refused.json()["error"]["message"]


# ---- the registry's one resolver ---------------------------------------------------------------


def test_the_registry_resolves_aliases_for_every_look_up():
    import asyncio

    from axon.server.errors import ModelNotFound

    from .test_node_api import Harness

    async def scenario():
        harness = Harness(model_aliases={CLAUDE: "m"})
        registry = harness.registry
        async with harness.client() as http:
            body = {"model_id": "org/model", "served_model_name": "m"}
            assert (await http.post("/models/load", json=body)).status_code == 200
            assert registry.get(CLAUDE) is registry.get("m") and CLAUDE in registry
            assert registry.status(CLAUDE) == "loaded" and registry.resolve("other") == "other"
            cards = (await http.get("/v1/models")).json()["data"]
            assert [(card["id"], card.get("parent")) for card in cards] == [
                ("m", None),
                (CLAUDE, "m"),
            ]
            unloaded = await http.post("/models/unload", json={"model_id": CLAUDE})
            assert unloaded.status_code == 200 and "m" not in registry
            with pytest.raises(ModelNotFound, match=f"'m' \\(as '{CLAUDE}'\\) is not loaded"):
                registry.get(CLAUDE)
            assert (await http.get("/v1/models")).json()["data"] == []  # no alias of nothing

    asyncio.run(scenario())
