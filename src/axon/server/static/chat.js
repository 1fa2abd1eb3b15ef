// The chat page: this server's OpenAI routes through fetch, answers streamed as server-sent
// events and rendered with AxonMarkdown. No framework and no build step; nothing leaves the server.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "axon.apiKey";
const MODEL_STORAGE = "axon.model";
const SETTINGS = [
  ["temperature", "temperature", Number],
  ["top-p", "top_p", Number],
  ["max-tokens", "max_tokens", (raw) => parseInt(raw, 10)],
];
const state = { history: [], images: [], capabilities: {}, controller: null, keyWaiters: [] };

function stored(name) {
  try {
    return localStorage.getItem(name);
  } catch {
    return null; // storage can be switched off; the page still works, it just forgets
  }
}

function store(name, value) {
  try {
    localStorage.setItem(name, value);
  } catch {
    /* see stored() */
  }
}

function showStatus(message) {
  $("status").textContent = message || "";
}

// ---- API key: a 401 shows the key form; the request is sent again once a key is entered.

function askForKey(message) {
  $("key-message").textContent = message;
  $("key-form").hidden = false;
  $("api-key").focus();
  return new Promise((resolve) => state.keyWaiters.push(resolve));
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  store(KEY_STORAGE, key);
  $("api-key").value = "";
  $("key-form").hidden = true;
  state.keyWaiters.splice(0).forEach((resolve) => resolve());
});

async function api(path, init = {}) {
  for (;;) {
    const key = stored(KEY_STORAGE);
    const headers = { ...(init.headers || {}) };
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    await askForKey(key ? "The API key was refused; enter the right one." : "This server needs an API key.");
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// ---- models: the picker lists /v1/models; the node API's /models says which take images.

async function loadModels() {
  const response = await api("v1/models");
  if (!response.ok) return showStatus(await errorMessage(response));
  const models = (await response.json()).data || [];
  const select = $("model");
  const wanted = select.value || stored(MODEL_STORAGE);
  select.replaceChildren(...models.map((model) => new Option(model.id, model.id)));
  if (models.some((model) => model.id === wanted)) select.value = wanted;
  showStatus(models.length ? "" : "No model is loaded on this server.");
  await loadCapabilities();
}

async function loadCapabilities() {
  try {
    const response = await api("models");
    if (!response.ok) return;
    for (const info of await response.json()) state.capabilities[info.id] = info.capabilities || [];
  } catch {
    // Behind a proxy that forwards /v1 only: no capabilities, so no attach button.
  } finally {
    updateAttach();
  }
}

function updateAttach() {
  const vision = (state.capabilities[$("model").value] || []).includes("vision");
  $("attach").hidden = !vision;
  if (!vision) setImages([]);
}

$("model").addEventListener("change", () => {
  store(MODEL_STORAGE, $("model").value);
  updateAttach();
});

// ---- images: sent as OpenAI image_url parts holding data: URIs.

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function imageElement(url) {
  const image = document.createElement("img");
  image.src = url;
  image.alt = "attached image";
  return image;
}

function setImages(images) {
  state.images = images;
  const thumbnails = images.map((url, index) => {
    const image = imageElement(url);
    image.title = "click to remove";
    image.addEventListener("click", () => setImages(state.images.filter((_, i) => i !== index)));
    return image;
  });
  $("attachments").replaceChildren(...thumbnails);
}

$("attach").addEventListener("click", () => $("image-input").click());
$("image-input").addEventListener("change", async () => {
  const added = await Promise.all([...$("image-input").files].map(readDataUrl));
  $("image-input").value = "";
  setImages([...state.images, ...added]);
});

// ---- one answer: its deltas, its bubble, its speed.

class Answer {
  constructor(element) {
    this.element = element;
    this.content = "";
    this.reasoning = "";
    this.chunks = 0; // deltas with text: the token count when no usage arrives (a stopped answer)
    this.usage = null;
    this.started = performance.now();
    this.firstToken = null;
    this.body = document.createElement("div");
    this.body.className = "content";
    element.append(this.body);
  }

  add(chunk) {
    if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
    if (chunk.usage) this.usage = chunk.usage;
    const delta = chunk.choices?.[0]?.delta;
    if (!delta || !(delta.content || delta.reasoning_content)) return;
    this.chunks += 1;
    this.firstToken ??= performance.now();
    this.content += delta.content || "";
    this.reasoning += delta.reasoning_content || "";
  }

  render() {
    if (this.reasoning && !this.details) {
      // Collapsed until opened; made once so that an open one stays open while text arrives.
      this.details = document.createElement("details");
      this.details.className = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      this.thoughts = document.createElement("div");
      this.details.append(summary, this.thoughts);
      this.element.prepend(this.details);
    }
    if (this.details) this.thoughts.innerHTML = AxonMarkdown.render(this.reasoning);
    this.body.innerHTML = AxonMarkdown.render(this.content);
  }

  note(text, className) {
    const line = document.createElement("div");
    line.className = className;
    line.textContent = text;
    this.element.append(line);
  }

  stats() {
    const tokens = this.usage?.completion_tokens ?? this.chunks;
    const now = performance.now();
    // The decode speed: tokens after the first over the time since it came.
    const decoding = tokens > 1 && this.firstToken !== null ? (now - this.firstToken) / 1000 : 0;
    const rate = decoding > 0 ? (tokens - 1) / decoding : tokens / ((now - this.started) / 1000);
    return `${tokens} tokens · ${rate.toFixed(1)} tok/s`;
  }
}

// ---- sending: a streamed chat completion read with fetch + ReadableStream.

function requestBody(history) {
  const body = {
    model: $("model").value,
    messages: history,
    stream: true,
    stream_options: { include_usage: true },
  };
  for (const [id, name, parse] of SETTINGS) {
    const raw = $(id).value.trim();
    if (raw !== "") body[name] = parse(raw);
  }
  return body;
}

function eventData(event) {
  const lines = event.split(/\r?\n/).filter((line) => line.startsWith("data:"));
  return lines.map((line) => line.slice(5).replace(/^ /, "")).join("\n");
}

async function streamAnswer(answer, body, signal) {
  const response = await api("v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    const events = (buffered + value).split(/\r?\n\r?\n/);
    buffered = events.pop(); // an event cut in two by the network waits for its second half
    for (const event of events) {
      const data = eventData(event);
      if (data && data !== "[DONE]") answer.add(JSON.parse(data));
    }
    answer.render();
  }
}

function addMessage(role) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  $("messages").append(element);
  return element;
}

function userTurn(text, images) {
  const element = addMessage("user");
  element.textContent = text;
  element.append(...images.map(imageElement));
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  return { role: "user", content: images.length ? [{ type: "text", text }, ...parts] : text };
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("model").disabled = busy;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (state.controller || !$("model").value || (!text && !state.images.length)) return;
  const history = state.history; // "New chat" swaps in a new array; this answer keeps its own
  history.push(userTurn(text, state.images));
  $("prompt").value = "";
  setImages([]);
  const answer = new Answer(addMessage("assistant"));
  const controller = (state.controller = new AbortController());
  setBusy(true);
  try {
    await streamAnswer(answer, requestBody(history), controller.signal);
  } catch (error) {
    if (error.name === "AbortError") answer.note("stopped", "stopped-note");
    else answer.note(error.message || String(error), "error");
  } finally {
    answer.render();
    // A turn without an answer leaves the history, so that the next message can follow a user one.
    if (answer.content) history.push({ role: "assistant", content: answer.content });
    else history.pop();
    $("stats").textContent = answer.stats();
    state.controller = null;
    setBusy(false);
  }
}

$("composer").addEventListener("submit", send);
$("stop").addEventListener("click", () => state.controller?.abort());
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("new-chat").addEventListener("click", () => {
  state.controller?.abort();
  state.history = [];
  $("messages").replaceChildren();
  $("stats").textContent = "";
});

loadModels().catch((error) => showStatus(`Could not list the models: ${error.message}`));
