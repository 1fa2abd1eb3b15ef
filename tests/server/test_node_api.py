"""The node API in process, over httpx's ASGI transport, with fake engines (no model, no torch):
shapes, statuses, errors, API-key enforcement, recovery; and the discovery parsers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from axon.server.app import create_app
from axon.server.config import ServerConfig
from axon.server.errors import ModelNotFound, ModelUnavailable, Unprocessable
from axon.server.lifecycle import discovery
from axon.server.lifecycle.registry import ActivationTracker, ModelRegistry
from axon.server.schemas.node_protocol import EngineArgs, ModelSpec
from axon.server.state import AppState

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


class FakeModel:
    """Stands in for ServedModel: the attributes and coroutines the registry and routes use."""

    def __init__(self, model_id, model_path, engine_args, spec, server_config, chat_template):
        self.id, self.spec, self.model_path = model_id, spec, model_path
        self.engine_args, self.chat_template = engine_args, chat_template
        self.status = "loaded"
        self.devices, self.capabilities = [], ["text"]
        self.max_model_len, self.created = 128, 1
        self.parameter_bytes = {"total": 1000, "active": 250}  # as engine_info reports them
        self.on_poisoned = None
        self.shutdown_graces: list[float] = []
        self.killed = False

    def kill(self) -> None:
        self.killed = True

    async def memory(self) -> dict:
        return {"used_bytes": 3 * 2**20, "free_bytes": 1, "total_bytes": 4 * 2**20}

    async def shutdown(self, grace_s: float) -> None:
        self.shutdown_graces.append(grace_s)


class Harness:
    """A registry with fake engines; `gates[model_id]` (an Event) holds that model's start."""

    def __init__(self, **config):
        self.started: list[FakeModel] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.preflight_errors: dict[str, Exception] = {}
        self.trusted: list[bool] = []  # per resolve: whether the spec was the operator's own
        self.config = ServerConfig(**config)
        self.registry = ModelRegistry(self.config, starter=self.start, resolver=self.resolve)
        self.state = AppState(config=self.config, registry=self.registry)

    def resolve(self, spec, config, trusted) -> Path:
        self.trusted.append(trusted)
        if spec.model_id in self.preflight_errors:
            raise self.preflight_errors[spec.model_id]
        return Path("/models") / spec.model_id

    async def start(self, model_id, *args, chat_template=None, previous=None, on_progress=None):
        if model_id in self.gates:
            on_progress(300, 1000)  # what an engine reports while it loads
            await self.gates[model_id].wait()
        model = FakeModel(model_id, *args, chat_template)
        self.started.append(model)
        return model

    def client(self) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=create_app(self.state))
        return httpx.AsyncClient(transport=transport, base_url="http://node")


def run(coroutine):
    return asyncio.run(coroutine)


def test_load_list_endpoint_unload():
    async def scenario():
        harness = Harness(engine=EngineArgs(max_num_seqs=4))
        async with harness.client() as http:
            assert (await http.get("/models")).json() == []
            body = {"model_id": "org/model", "served_model_name": "m", "max_model_len": 64}
            response = await http.post("/models/load", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["status"] == "loaded" and response.json()["model_id"] == "m"
            assert harness.started[0].engine_args == {"max_num_seqs": 4, "max_model_len": 64}
            (info,) = (await http.get("/models")).json()
            assert info["id"] == "m" and info["model_id"] == "org/model"
            assert info["status"] == "loaded" and info["capabilities"] == ["text"]
            assert info["vram_used_mb"] == 3 and info["memory"]["total_bytes"] == 4 * 2**20
            assert (await http.get("/models/m/endpoint")).json() == {"url": "http://127.0.0.1:8000"}
            again = await http.post("/models/load", json=body)
            assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
            unloaded = await http.post("/models/unload", json={"model_id": "m"})
            assert unloaded.json() == {"status": "unloaded", "model_id": "m"}
            assert harness.started[0].shutdown_graces == [20.0]
            assert (await http.get("/models")).json() == []
            missing = await http.post("/models/unload", json={"model_id": "m"})
            assert missing.status_code == 404
            assert (await http.get("/models/m/endpoint")).status_code == 404

    run(scenario())


def test_ids_with_a_slash():
    async def scenario():
        harness = Harness()
        async with harness.client() as http:
            await http.post("/models/load", json={"model_id": "org/name"})
            assert (await http.get("/models/org/name/endpoint")).status_code == 200
            assert (await http.get("/models/org%2Fname/endpoint")).status_code == 200

    run(scenario())


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"model_id": "m", "harness": "candle"}, 400, "unknown harness"),
        ({"model_id": "m", "harness": "axon"}, 200, None),
        ({"quant": "Q4"}, 400, "model_id"),
        ({"model_id": "m", "max_num_seqs": 0}, 400, "max_num_seqs"),
        ({"model_id": "m", "kv_cache_memory": "lots"}, 400, "kv_cache_memory"),
        ({"model_id": "m", "max_batch": 3}, 400, "max_batch"),
    ],
)
def test_load_validation(body, status, needle):
    async def scenario():
        async with Harness().client() as http:
            response = await http.post("/models/load", json=body)
            assert response.status_code == status, response.text
            if needle:
                assert needle in response.text

    run(scenario())


def test_preflight_error_is_422_with_kind():
    async def scenario():
        harness = Harness()
        harness.preflight_errors["org/q"] = Unprocessable(
            "no match",
            code="quant_not_found",
            extra={"kind": "quant_not_found", "model_id": "org/q"},
        )
        async with harness.client() as http:
            response = await http.post("/models/load", json={"model_id": "org/q", "quant": "x"})
            assert response.status_code == 422
            error = response.json()["error"]
            assert error["kind"] == "quant_not_found" and error["model_id"] == "org/q"
            assert (await http.get("/models")).json() == []  # a failed load leaves nothing

    run(scenario())


def test_loading_status_and_independent_models():
    async def scenario():
        harness = Harness()
        harness.gates["slow"] = asyncio.Event()
        async with harness.client() as http:
            await http.post("/models/load", json={"model_id": "fast"})
            slow = asyncio.create_task(http.post("/models/load", json={"model_id": "slow"}))
            await asyncio.sleep(0.05)
            statuses = {m["id"]: m["status"] for m in (await http.get("/models")).json()}
            assert statuses == {"fast": "loaded", "slow": "loading"}
            assert harness.registry.get("fast").id == "fast"  # unaffected by the other load
            with pytest.raises(ModelUnavailable) as info:
                harness.registry.get("slow")
            assert info.value.headers["Retry-After"]
            await http.post("/models/unload", json={"model_id": "fast"})  # during the other load
            harness.gates["slow"].set()
            assert (await slow).status_code == 200
            assert [m["id"] for m in (await http.get("/models")).json()] == ["slow"]


def test_load_progress_in_models_and_health():
    async def scenario():
        harness = Harness()
        harness.gates["slow"] = asyncio.Event()
        harness.state.activation = ActivationTracker(pending=["slow"])
        harness.state.activation.start("slow")
        async with harness.client() as http:
            slow = asyncio.create_task(http.post("/models/load", json={"model_id": "slow"}))
            await asyncio.sleep(0.05)
            (info,) = (await http.get("/models")).json()
            progress = {"loaded_bytes": 300, "total_bytes": 1000}
            assert info["status"] == "loading" and info["load_progress"] == progress
            activation = (await http.get("/health")).json()["activation"]
            assert activation["in_progress"] == "slow" and activation["progress"] == progress
            harness.gates["slow"].set()
            assert (await slow).status_code == 200
            (info,) = (await http.get("/models")).json()
            assert info["status"] == "loaded" and info["load_progress"] is None

    asyncio.run(scenario())


def test_models_show_total_and_active_parameter_bytes():
    async def scenario():
        harness = Harness()
        harness.gates["slow"] = asyncio.Event()
        async with harness.client() as http:
            await http.post("/models/load", json={"model_id": "moe"})
            slow = asyncio.create_task(http.post("/models/load", json={"model_id": "slow"}))
            await asyncio.sleep(0.05)
            infos = {m["id"]: m for m in (await http.get("/models")).json()}
            assert infos["moe"]["parameter_bytes"] == {"total": 1000, "active": 250}
            assert infos["slow"]["parameter_bytes"] is None  # not loaded yet
            harness.gates["slow"].set()
            await slow

    asyncio.run(scenario())


def test_unload_cancels_a_load_in_progress():
    async def scenario():
        harness = Harness()
        harness.gates["slow"] = asyncio.Event()  # never set: the load would wait forever
        async with harness.client() as http:
            slow = asyncio.create_task(http.post("/models/load", json={"model_id": "slow"}))
            await asyncio.sleep(0.05)
            unloaded = await http.post("/models/unload", json={"model_id": "slow"})
            assert unloaded.status_code == 200, unloaded.text
            cancelled = await asyncio.wait_for(slow, 5)
            assert cancelled.status_code == 409
            assert "unloaded while it loaded" in cancelled.json()["error"]["message"]
            assert (await http.get("/models")).json() == []
            # The id is free again: a new load of it goes through.
            harness.gates["slow"].set()
            assert (await http.post("/models/load", json={"model_id": "slow"})).status_code == 200

    run(scenario())


def test_poisoned_model_recovers_single_flight():
    async def scenario():
        harness = Harness()
        model = await harness.registry.load(harness_spec("m"))
        harness.gates["m"] = asyncio.Event()  # hold the restart to observe `recovering`
        model.status = "poisoned"
        model.on_poisoned("cuda error: illegal memory access")
        model.on_poisoned("again")  # single-flight: ignored
        await asyncio.sleep(0)
        assert harness.registry.status("m") == "recovering"
        with pytest.raises(ModelUnavailable):
            harness.registry.get("m")
        harness.gates["m"].set()
        for _ in range(100):
            if harness.registry.status("m") == "loaded":
                break
            await asyncio.sleep(0.01)
        assert len(harness.started) == 2 and model.shutdown_graces == [0.0]
        assert harness.registry.get("m") is harness.started[1]

    run(scenario())


def test_poison_seen_by_get_triggers_recovery():
    async def scenario():
        harness = Harness()
        model = await harness.registry.load(harness_spec("m"))
        model.status = "poisoned"  # the callback never fired
        with pytest.raises(ModelUnavailable):
            harness.registry.get("m")
        for _ in range(100):
            if harness.registry.status("m") == "loaded":
                break
            await asyncio.sleep(0.01)
        assert harness.registry.get("m") is harness.started[1]

    run(scenario())


def test_a_failed_recovery_is_retried_with_backoff_then_failed():
    from axon.server.lifecycle.recovery import RECOVERY_MAX_DELAY_S, retry_delay_s

    assert [retry_delay_s(n, 1.0) for n in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 4.0]
    assert retry_delay_s(50, 1.0) == RECOVERY_MAX_DELAY_S

    async def scenario():
        harness = Harness(recovery_attempts=3, recovery_backoff_s=0.01)
        start, failures = harness.start, [0]

        async def flaky(model_id, *args, **kwargs):
            if failures[0]:
                failures[0] -= 1
                raise RuntimeError("no *.safetensors files")
            return await start(model_id, *args, **kwargs)

        harness.registry._start = flaky
        for fails, final in ((2, "loaded"), (3, "failed")):
            model = await harness.registry.load(harness_spec(final))
            failures[0] = fails
            model.status = "poisoned"
            model.on_poisoned("engine process killed by SIGKILL")
            for _ in range(200):
                if harness.registry.status(final) not in ("poisoned", "recovering"):
                    break
                await asyncio.sleep(0.01)
            (info,) = [i for i in await harness.registry.infos() if i.id == final]
            assert info.status == final
        assert info.recovery_attempt == 3 and info.recovery_attempts == 3
        assert "attempt 3 of 3 failed" in info.error and "safetensors" in info.error
        with pytest.raises(ModelUnavailable, match="failed"):
            harness.registry.get("failed")
        summary = {m["id"]: m for m in harness.registry.summary()}
        assert summary["loaded"] == {"id": "loaded", "status": "loaded"}
        assert summary["failed"]["status"] == "failed" and summary["failed"]["error"]
        await harness.registry.load(harness_spec("failed"))  # a failed model loads afresh
        assert harness.registry.status("failed") == "loaded"

    run(scenario())


def test_unload_all_closes_the_registry():
    async def scenario():
        harness = Harness()
        a = await harness.registry.load(harness_spec("a"))
        b = await harness.registry.load(harness_spec("b"))
        await harness.registry.unload_all(grace_s=3.0)
        assert a.shutdown_graces == [3.0] and b.shutdown_graces == [3.0]
        with pytest.raises(ModelUnavailable, match="shutting down"):
            harness.registry.get("a")
        with pytest.raises(ModelUnavailable):
            await harness.registry.load(harness_spec("c"))

    run(scenario())


def test_get_unknown_model():
    with pytest.raises(ModelNotFound):
        Harness().registry.get("nope")


def harness_spec(model_id: str) -> ModelSpec:
    return ModelSpec(model_id=model_id)


# ---- API key --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/models"),
        ("GET", "/discovery"),
        ("POST", "/models/load"),
        ("POST", "/models/unload"),
        ("GET", "/models/x/endpoint"),
        ("GET", "/v1/models"),
    ],
)
def test_api_key_required(method, path):
    async def scenario():
        async with Harness(api_key=KEY).client() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                response = await http.request(method, path, headers=headers, json={})
                assert response.status_code == 401, (headers, response.text)
                assert response.json()["error"]["type"] == "authentication_error"
                assert response.headers["www-authenticate"] == "Bearer"
            response = await http.request(method, path, headers=AUTH, json={})
            assert response.status_code != 401

    run(scenario())


def test_health_is_open_and_reports_activation():
    async def scenario():
        harness = Harness(api_key=KEY)
        harness.state.activation = ActivationTracker(pending=["b"], completed=["a"])
        async with harness.client() as http:
            health = (await http.get("/health")).json()
            assert health["status"] == "ok" and health["uptime_secs"] >= 0
            assert isinstance(health["devices"], list)
            assert health["activation"] == {
                "state": "pre_warming",
                "pending": ["b"],
                "in_progress": None,
                "completed": ["a"],
                "failed": [],
            }

    run(scenario())


def test_discovery_shape(monkeypatch):
    monkeypatch.setattr(discovery, "run_nvidia_smi", lambda *args, **kw: None)
    info = discovery.discover()
    assert info["devices"] == [] and info["harnesses"] == ["axon"]
    assert info["hostname"] and info["os"] and info["kernel"]
    assert info["cuda_version"] is None and info["cpu"]["count"] >= 1


# ---- activation and parsers -----------------------------------------------------------------


def test_activation_buckets():
    tracker = ActivationTracker(pending=["a", "b"])
    tracker.start("a")
    assert tracker.snapshot()["in_progress"] == "a" and tracker.pending == ["b"]
    tracker.finish("a")
    tracker.start("b")
    tracker.finish("b", error="boom")
    snap = tracker.snapshot()
    assert snap["completed"] == ["a"] and snap["failed"] == [{"model_id": "b", "error": "boom"}]
    assert snap["pending"] == [] and snap["in_progress"] is None


def test_parse_gpu_inventory():
    text = (
        "0, NVIDIA H200, 143771, 9.0, 550.54.15\n"
        "1, NVIDIA H200, 143771, 9.0, 550.54.15\n"
        "\n"
        "garbage line\n"
    )
    devices, driver = discovery.parse_gpu_inventory(text)
    assert driver == "550.54.15"
    assert devices[1] == {
        "index": 1,
        "name": "NVIDIA H200",
        "vram_total_mb": 143771,
        "compute_capability": "9.0",
    }
    assert discovery.parse_gpu_inventory("") == ([], None)


def test_parse_gpu_health():
    (device,) = discovery.parse_gpu_health("0, 1024, 80000, 37, [N/A]\n")
    assert device == {
        "index": 0,
        "vram_used_mb": 1024,
        "vram_free_mb": 80000,
        "utilization_pct": 37,
        "temp_c": None,
    }


def test_parse_cuda_version_and_meminfo():
    banner = "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4     |"
    assert discovery.parse_cuda_version(banner) == "12.4"
    assert discovery.parse_cuda_version("no gpu") is None
    meminfo = "MemTotal:       16384 kB\nMemFree:  100 kB\nMemAvailable:    8192 kB\n"
    assert discovery.parse_meminfo(meminfo) == {
        "total_bytes": 16384 * 1024,
        "available_bytes": 8192 * 1024,
    }


def test_health_probe_caches(monkeypatch):
    calls = []
    monkeypatch.setattr(discovery, "_query", lambda fields: calls.append(fields) or "")
    now = [0.0]
    probe = discovery.HealthProbe(ttl_s=5.0, clock=lambda: now[0])
    probe.devices()
    probe.devices()
    now[0] = 6.0
    probe.devices()
    assert len(calls) == 2


def test_missing_nvidia_smi(monkeypatch):
    monkeypatch.setattr(discovery.shutil, "which", lambda name: None)
    assert discovery.run_nvidia_smi("-L") is None


# ---- local files: the seam between trusted (operator) and HTTP specs ------------------------


def test_http_loads_are_untrusted_and_templates_are_read_once(tmp_path):
    from axon.server.serve import load_default_models

    async def scenario():
        harness = Harness(
            allowed_local_model_paths=(str(tmp_path),), chat_template_dir=str(tmp_path)
        )
        (tmp_path / "t.jinja").write_text("T {{ messages }}")
        operator = ModelSpec(model_id="org/a", chat_template=str(tmp_path / "t.jinja"))
        await load_default_models(harness.registry, [operator], ActivationTracker())
        async with harness.client() as http:
            body = {"model_id": "org/b", "chat_template": "/etc/passwd"}
            refused = await http.post("/models/load", json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert (error["code"], error["param"]) == ("model_path_not_allowed", "chat_template")
            assert "root:" not in refused.text
            body["chat_template"] = str(tmp_path / "t.jinja")
            assert (await http.post("/models/load", json=body)).status_code == 200
            (card,) = [
                c for c in (await http.get("/v1/models")).json()["data"] if c["id"] == "org/b"
            ]
            assert card["root"] == "org/b"  # the repo id, never the resolved local path
        assert harness.trusted == [True, False]  # the refused one never reached the resolver
        # The engine gets the template text, not the path; recovery reuses it unread.
        (tmp_path / "t.jinja").unlink()
        model = harness.registry.get("org/a")
        model.status = "poisoned"
        model.on_poisoned("device fault")
        for _ in range(100):
            if harness.registry.status("org/a") == "loaded":
                break
            await asyncio.sleep(0.01)
        texts = [started.chat_template for started in harness.started]
        assert texts == ["T {{ messages }}"] * 3

    run(scenario())


def test_tensor_parallel_and_devices_are_never_silently_ignored(monkeypatch):
    monkeypatch.setattr(discovery, "gpu_indices", lambda: (0, 1))

    async def scenario():
        harness = Harness()
        async with harness.client() as http:
            for spec, code, param in [
                ({"model_id": "m", "tensor_parallel": 2, "devices": [0]}, None, "devices"),
                ({"model_id": "m", "devices": [99]}, "device_not_found", "devices"),
                ({"model_id": "m", "devices": [0, 1]}, None, "devices"),  # 2 GPUs, 1 rank
            ]:
                response = await http.post("/models/load", json=spec)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["code"] == code and error["param"] == param
            assert harness.started == []  # refused before any work
            loaded = await http.post("/models/load", json={"model_id": "m", "devices": [1]})
            assert loaded.status_code == 200
            assert harness.started[0].spec.devices == [1]
            spec = {"model_id": "tp", "tensor_parallel": 2, "devices": [0, 1]}
            assert (await http.post("/models/load", json=spec)).status_code == 200
            assert harness.started[1].engine_args["tensor_parallel_size"] == 2

    run(scenario())


def test_devices_pin_the_engine_to_those_gpus():
    from axon.server.lifecycle.served_model import _device_env

    assert _device_env(ModelSpec(model_id="m", devices=[2, 3])) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert _device_env(ModelSpec(model_id="m")) == {}
