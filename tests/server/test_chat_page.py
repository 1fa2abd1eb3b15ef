"""The chat page at `/` in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
driven with selenium) against a real `axon serve` on the tiny model: it lists the model, streams
an answer equal to the API's greedy one, stops a long answer, sends images as data: URIs, and asks
for the API key when the server has one. Then as a new user meets it: `axon serve` with no model
(the demo models), where the page picks the chat demo and answers a plain question in words.
Without the browser the tests skip, except under CI, where they fail: .ci/run installs it."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from axon.demo import CHAT_DEMO_MODEL_ID, DEMO_MODEL_ID
from tests.server.conftest import MODEL_ID, Server, spawn_serve, stop_server

API_KEY = "chat-page-secret"
LONG_CONTEXT = 32768
LONG_TOKENS = 30000  # seconds of generation: still running when Stop is clicked
STATS = re.compile(r"(\d+) tokens · (\d+\.\d) tok/s")
LAST_ANSWER = "#messages .message.assistant:last-child"
# Every text the last answer shows, in order: a MutationObserver sees each streamed update.
RECORD_ANSWER_TEXTS = """
window.seenTexts = [];
new MutationObserver(() => {
  const content = document.querySelector("#messages .message.assistant:last-child .content");
  if (content) window.seenTexts.push(content.textContent);
}).observe(document.getElementById("messages"),
           {childList: true, subtree: true, characterData: true});
"""
STOP_AT_THREE_WORDS = """
const stopper = new MutationObserver(() => {
  const content = document.querySelector("#messages .message.assistant:last-child .content");
  if (content && content.textContent.split(" ").length >= 3) {
    stopper.disconnect();
    document.getElementById("stop").click();
  }
});
stopper.observe(document.getElementById("messages"),
                {childList: true, subtree: true, characterData: true});
"""
# The bodies the page posts, as it sent them.
RECORD_BODIES = """
window.sentBodies = [];
const realFetch = window.fetch;
window.fetch = (url, init) => {
  if (init && init.body) window.sentBodies.push(init.body);
  return realFetch(url, init);
};
"""


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
MISSING = None if CHROMIUM and CHROMEDRIVER else "needs Debian's chromium and chromium-driver"
UNDER_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
if MISSING and not UNDER_CI:
    pytest.skip(MISSING, allow_module_level=True)


@pytest.fixture(scope="module")
def browser_paths() -> tuple[str, str]:
    """Chromium and its chromedriver; under CI (where the module does not skip) a failure."""
    if MISSING:
        pytest.fail(f"CI is set, so this does not skip: {MISSING} (.ci/run installs them)")
    return CHROMIUM, CHROMEDRIVER


@pytest.fixture(scope="module")
def browser(browser_paths):
    chromium, driver_path = browser_paths
    options = Options()
    options.binary_location = chromium
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    yield driver
    driver.quit()


def long_context_copy(model_dir: Path, copy_dir: Path) -> Path:
    """The tiny model with a 32k context and no EOS token: a stream long enough to be stopped
    mid-way even when the browser lags far behind the server on a busy machine (with its EOS, the
    greedy answer to "tell me a story" ends by itself after ~85 tokens, and a late Stop then
    finds nothing to abort)."""
    shutil.copytree(model_dir, copy_dir)
    config = json.loads((copy_dir / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    config["eos_token_id"] = None
    (copy_dir / "config.json").write_text(json.dumps(config))
    generation = json.loads((copy_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = None
    (copy_dir / "generation_config.json").write_text(json.dumps(generation))
    return copy_dir


@pytest.fixture(scope="module", autouse=True)
def key_server_starting(browser_paths, tiny_chat_model: Path, tmp_path_factory):
    """A second server, with `--api-key` and a long context, started in the background before
    the first test so that it loads while the others run."""
    model_dir = long_context_copy(tiny_chat_model, tmp_path_factory.mktemp("chat") / "model")
    args = [str(model_dir), "--port", "0", "--served-model-name", MODEL_ID]
    args += ["--max-model-len", str(LONG_CONTEXT), "--kv-cache-memory", "24M"]
    args += ["--dtype", "float32", "--log-level", "warning", "--api-key", API_KEY]
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(spawn_serve, args)
        yield starting
        if starting.exception() is None:
            stop_server(starting.result())


@pytest.fixture(scope="module", autouse=True)
def demo_server_starting(browser_paths):
    """`axon serve` with no model: the demo models from the packages setup installs (a missing
    package fails the test: scripts/setup.sh installs both), started in the background too."""
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(spawn_serve, ["--port", "0", "--log-level", "warning"])
        yield starting
        if starting.exception() is None:
            stop_server(starting.result())


def wait_for_models(server: Server, model_ids: set[str], headers: dict | None = None) -> list:
    """The ids /v1/models lists, in order, once `model_ids` are all among them."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.process.poll() is None, "axon serve exited:\n" + "".join(server.log)
        models = httpx.get(server.openai_url + "/models", headers=headers, timeout=5).json()
        listed = [model["id"] for model in models["data"]]
        if model_ids <= set(listed):
            return listed
        time.sleep(0.2)
    raise AssertionError(f"{model_ids} did not load in time:\n" + "".join(server.log))


@pytest.fixture()
def key_server(key_server_starting) -> Server:
    """The `--api-key` server once its model serves."""
    server = key_server_starting.result()
    wait_for_models(server, {MODEL_ID}, headers={"Authorization": f"Bearer {API_KEY}"})
    return server


@pytest.fixture()
def chat_server(request) -> Server:
    """conftest's shared server, asked for only once the test runs: as an argument, being
    session-scoped, it would load before the key server could start."""
    return request.getfixturevalue("server")


def wait_for(browser, what: str, condition, timeout_s: float = 20.0):
    wait = WebDriverWait(browser, timeout_s, poll_frequency=0.02)
    return wait.until(lambda _: condition(), f"not within {timeout_s}s: {what}")


def element(browser, element_id: str):
    return browser.find_element(By.ID, element_id)


def pick_model(browser) -> None:
    """Picks the tiny model once the picker lists it."""
    options = lambda: [o.get_attribute("value") for o in Select(element(browser, "model")).options]
    wait_for(browser, "the picker lists the model", lambda: MODEL_ID in options())
    Select(element(browser, "model")).select_by_value(MODEL_ID)


def open_page(browser, base_url: str) -> None:
    browser.get(base_url + "/")
    pick_model(browser)


def set_sampling(browser, **values) -> None:
    if not element(browser, "settings").get_attribute("open"):
        browser.find_element(By.CSS_SELECTOR, "#settings summary").click()
    for name, value in values.items():
        field = element(browser, name.replace("_", "-"))
        field.clear()
        field.send_keys(str(value))


def send(browser, text: str) -> None:
    element(browser, "prompt").send_keys(text)
    element(browser, "send").click()  # the page turns busy inside the click's handler


def answer_text(browser) -> str:
    return browser.execute_script(
        f"const c = document.querySelector('{LAST_ANSWER} .content'); return c && c.textContent"
    )


def wait_until_ready(browser) -> None:
    """Waits for the answer to end: Send usable again, Stop not."""
    ready = lambda: (
        element(browser, "send").is_enabled() and not element(browser, "stop").is_enabled()
    )
    wait_for(browser, "Send enabled, Stop disabled", ready)


def stats_tokens(browser) -> int:
    match = STATS.fullmatch(element(browser, "stats").text)
    assert match, element(browser, "stats").text
    assert float(match.group(2)) > 0
    return int(match.group(1))


def greedy_answer(server: Server, text: str, max_tokens: int, key: str | None = None) -> dict:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": text}]}
    body.update(temperature=0, max_tokens=max_tokens)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = server.openai_url + "/chat/completions"
    response = httpx.post(url, json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def slow_network(browser, bytes_per_s: int) -> None:
    """Chromium's own network throttling (DevTools protocol; -1 lifts it): the stream then
    reaches the page in pieces, as over a real link. On the loopback a loaded machine could
    hand the page the whole answer in one read, which it rightly renders once."""
    browser.execute_cdp_cmd("Network.enable", {})
    conditions = {"offline": False, "latency": 0, "uploadThroughput": -1}
    browser.execute_cdp_cmd(
        "Network.emulateNetworkConditions", {**conditions, "downloadThroughput": bytes_per_s}
    )


def test_streams_the_greedy_answer_of_the_api(browser, chat_server):
    open_page(browser, chat_server.base_url)
    set_sampling(browser, temperature=0, max_tokens=200)
    browser.execute_script(RECORD_ANSWER_TEXTS)
    slow_network(browser, 20_000)  # ~40 KB of events: about 2 s
    try:
        send(browser, "hello world")
        wait_until_ready(browser)
    finally:
        slow_network(browser, -1)

    expected = greedy_answer(chat_server, "hello world", 200)
    final = answer_text(browser)
    assert final == expected["choices"][0]["message"]["content"].strip()
    assert len(final.split()) == 200
    seen = browser.execute_script("return window.seenTexts")
    assert any(0 < len(text) < len(final) for text in seen), "no partial answer was shown"
    assert all(final.startswith(text) for text in seen), "the shown text did not only grow"
    assert [len(text) for text in seen] == sorted(len(text) for text in seen)
    assert stats_tokens(browser) == expected["usage"]["completion_tokens"]
    assert not browser.find_elements(By.CSS_SELECTOR, f"{LAST_ANSWER} .error")


def test_an_image_goes_as_a_data_uri_part_for_a_vision_model(browser, chat_server, tmp_path):
    from PIL import Image

    open_page(browser, chat_server.base_url)
    assert not element(browser, "attach").is_displayed()  # the tiny model is text-only
    # No tiny vision model yet: the page is told this one is, as GET /models would say.
    browser.execute_script(f"state.capabilities['{MODEL_ID}'] = ['text', 'vision']; updateAttach()")
    assert element(browser, "attach").is_displayed()
    image_path = tmp_path / "dot.png"
    Image.new("RGB", (2, 2), (255, 0, 0)).save(image_path)
    browser.execute_script(RECORD_BODIES)
    file_input = element(browser, "image-input")
    browser.execute_script("arguments[0].hidden = false", file_input)  # as the Attach button's
    file_input.send_keys(str(image_path))
    thumbnails = lambda: browser.find_elements(By.CSS_SELECTOR, "#attachments img")
    wait_for(browser, "a thumbnail of the image", thumbnails)
    set_sampling(browser, max_tokens=2)
    send(browser, "what is this")
    wait_until_ready(browser)

    body = json.loads(browser.execute_script("return window.sentBodies.at(-1)"))
    data_uri = "data:image/png;base64," + base64.b64encode(image_path.read_bytes()).decode()
    assert body["messages"][-1] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": data_uri}},
        ],
    }
    assert browser.find_elements(By.CSS_SELECTOR, "#messages .message.user img")
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments img")


def test_markdown_is_rendered_safely_and_reasoning_collapsed(browser, chat_server):
    open_page(browser, chat_server.base_url)
    render = lambda text: browser.execute_script("return AxonMarkdown.render(arguments[0])", text)
    assert render("<img src=x onerror=alert(1)>") == "<p>&lt;img src=x onerror=alert(1)&gt;</p>"
    link = '<a href="https://x.org/?q=1&amp;r=&quot;" target="_blank" rel="noopener noreferrer">'
    assert render('[a](javascript:alert(1)) [b](https://x.org/?q=1&r=")') == (
        f"<p>[a](javascript:alert(1)) {link}b</a></p>"
    )
    assert render("**b** *i* `*c*` snake_case") == (
        "<p><strong>b</strong> <em>i</em> <code>*c*</code> snake_case</p>"
    )
    assert render("- one\n- two\n\n1. first") == (
        "<ul><li>one</li><li>two</li></ul>\n<ol><li>first</li></ol>"
    )
    assert render("```py\n<b>*x*</b>\n```") == (
        '<pre><code class="language-py">&lt;b&gt;*x*&lt;/b&gt;</code></pre>'
    )
    # A reasoning model's deltas: the thoughts go in a closed <details>, the answer below it.
    browser.execute_script(
        "const answer = new Answer(addMessage('assistant'));"
        "answer.add({choices: [{delta: {reasoning_content: 'think **hard**'}}]});"
        "answer.add({choices: [{delta: {content: 'the *answer*'}}]});"
        "answer.render();"
    )
    details = browser.find_element(By.CSS_SELECTOR, f"{LAST_ANSWER} details.reasoning")
    assert details.get_attribute("open") is None
    assert details.find_element(By.TAG_NAME, "summary").text == "Reasoning"
    assert "<strong>hard</strong>" in details.get_attribute("innerHTML")
    assert browser.find_element(By.CSS_SELECTOR, f"{LAST_ANSWER} .content em").text == "answer"


def test_only_the_page_is_open_with_an_api_key(key_server):
    page = httpx.get(key_server.base_url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for path in ("/static/chat.js", "/static/markdown.js", "/static/chat.css"):
        assert httpx.get(key_server.base_url + path, timeout=10).status_code == 200
    for path in ("/v1/models", "/models", "/openapi.json", "/docs", "/discovery"):
        assert httpx.get(key_server.base_url + path, timeout=10).status_code == 401, path
    assert httpx.get(key_server.base_url + "/static/%2e%2e/app.py", timeout=10).status_code == 404


def test_the_page_asks_for_the_api_key_and_keeps_it(browser, key_server):
    browser.get(key_server.base_url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    for key, message in (("wrong", "needs an API key"), (API_KEY, "was refused")):
        wait_for(browser, "the key form", lambda: element(browser, "key-form").is_displayed())
        wait_for(browser, message, lambda m=message: m in element(browser, "key-message").text)
        element(browser, "api-key").send_keys(key)
        element(browser, "api-key-save").click()
    pick_model(browser)
    assert not element(browser, "key-form").is_displayed()
    open_page(browser, key_server.base_url)  # again, now with the key in localStorage
    assert not element(browser, "key-form").is_displayed()
    assert browser.execute_script("return localStorage.getItem('axon.apiKey')") == API_KEY
    set_sampling(browser, temperature=0, max_tokens=8)
    send(browser, "hello world")
    wait_until_ready(browser)
    expected = greedy_answer(key_server, "hello world", 8, key=API_KEY)
    assert answer_text(browser) == expected["choices"][0]["message"]["content"].strip()


def test_stop_ends_the_stream_and_the_page_takes_the_next_message(browser, key_server):
    browser.get(key_server.base_url + "/")
    browser.execute_script("localStorage.setItem('axon.apiKey', arguments[0])", API_KEY)
    open_page(browser, key_server.base_url)
    set_sampling(browser, temperature=0, max_tokens=LONG_TOKENS)
    aborted = key_server.metric("axon:request_success_total", finished_reason="abort")
    # Stop is clicked from the page as soon as three words show: a click from here could come
    # late on a busy machine.
    browser.execute_script(STOP_AT_THREE_WORDS)
    send(browser, "tell me a story")
    wait_until_ready(browser)

    stopped = answer_text(browser)
    assert browser.find_elements(By.CSS_SELECTOR, f"{LAST_ANSWER} .stopped-note")
    assert 3 <= stats_tokens(browser) < LONG_TOKENS
    # The server stopped generating too: the request ended as an abort, and nothing runs.
    running = lambda: key_server.metric("axon:num_requests_running")
    wait_for(browser, "no request running", lambda: running() == 0)
    abort_count = lambda: key_server.metric("axon:request_success_total", finished_reason="abort")
    wait_for(browser, "one more aborted request", lambda: abort_count() == aborted + 1)
    assert answer_text(browser) == stopped, "text arrived after the stop"

    set_sampling(browser, max_tokens=4)
    send(browser, "hello")
    wait_until_ready(browser)
    assert 1 <= len(answer_text(browser).split()) <= 4
    assert len(browser.find_elements(By.CSS_SELECTOR, "#messages .message.user")) == 2


def test_the_demo_page_picks_the_chat_model_and_answers_in_words(browser, demo_server_starting):
    server = demo_server_starting.result()
    listed = wait_for_models(server, {CHAT_DEMO_MODEL_ID, DEMO_MODEL_ID})
    assert listed[0] == CHAT_DEMO_MODEL_ID  # what a client listing models meets first
    nodes = {info["id"]: info for info in httpx.get(server.base_url + "/models").json()}
    assert nodes[CHAT_DEMO_MODEL_ID]["activation_precision"] == "float32"  # see _demo_args
    browser.get(server.base_url + "/")
    picked = lambda: Select(element(browser, "model")).first_selected_option.get_attribute("value")
    wait_for(
        browser,
        "the picker lists the demo models",
        lambda: len(listed) == len(Select(element(browser, "model")).options),
    )
    assert picked() == CHAT_DEMO_MODEL_ID  # nothing chosen before: the chat model, not the base
    set_sampling(browser, temperature=0, max_tokens=40)
    send(browser, "What is the capital of France?")
    wait_until_ready(browser)

    answer = answer_text(browser)
    body = {"model": CHAT_DEMO_MODEL_ID, "temperature": 0, "max_tokens": 40}
    body["messages"] = [{"role": "user", "content": "What is the capital of France?"}]
    expected = httpx.post(server.openai_url + "/chat/completions", json=body, timeout=60).json()
    assert answer == expected["choices"][0]["message"]["content"].strip()
    assert "Paris" in answer
    # Readable text: words and punctuation, no markup soup (the base model's `<inline>` tags).
    assert not re.search(r"[<>{}\[\]]", answer), answer
    assert len(re.findall(r"[A-Za-z]+", answer)) >= 4
    assert not browser.find_elements(By.CSS_SELECTOR, f"{LAST_ANSWER} .error")
