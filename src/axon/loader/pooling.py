"""How an embedding model pools its hidden states: read once from the checkpoint's
sentence-transformers files (`modules.json`, `1_Pooling/config.json`, a `Normalize` module) and
its Matryoshka markers. Pure Python: no torch here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# sentence-transformers' pooling flags, and the one mode each means here.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_UNSUPPORTED = (
    "pooling_mode_cls_token",
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "last"  # "last": the prompt's last token; "mean": the mean over the prompt
    normalize: bool = True  # L2-normalise the pooled vector
    # Matryoshka: whether a prefix of the vector is itself an embedding (so `dimensions` may
    # truncate it), and the prefix lengths the checkpoint names (None: any length).
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def info(self) -> dict:
        """What the HTTP process needs to know (engine_info)."""
        dims = self.matryoshka_dimensions
        return {
            "mode": self.mode,
            "normalize": self.normalize,
            "matryoshka": self.matryoshka,
            "matryoshka_dimensions": list(dims) if dims is not None else None,
        }


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _modules(model_dir: Path) -> list[dict]:
    modules = _read_json(model_dir / "modules.json")
    return modules if isinstance(modules, list) else []


def _pooling_mode(model_dir: Path, module: dict) -> str:
    """The mode a Pooling module's config selects; ValueError for a mode axon lacks."""
    path = model_dir / module.get("path", "") / "config.json"
    config = _read_json(path) or {}
    chosen = [mode for flag, mode in _MODES.items() if config.get(flag)]
    unsupported = [flag for flag in _UNSUPPORTED if config.get(flag)]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{path}: pooling must be exactly one of {sorted(_MODES)}, got "
            f"{sorted(flag for flag in (*_MODES, *_UNSUPPORTED) if config.get(flag))}"
        )
    return chosen[0]


def _matryoshka(model_dir: Path, hf_config) -> tuple[bool, tuple[int, ...] | None]:
    """(supported, dimensions) from `matryoshka_dimensions` / `is_matryoshka` in config.json
    (the hf config) or config_sentence_transformers.json."""
    st_config = _read_json(model_dir / "config_sentence_transformers.json") or {}
    for source in (vars(hf_config) if hf_config is not None else {}, st_config):
        dims = source.get("matryoshka_dimensions")
        if dims:
            return True, tuple(sorted(int(d) for d in dims))
        if source.get("is_matryoshka"):
            return True, None
    return False, None


def has_pooling_config(model_dir: str) -> bool:
    """Whether the checkpoint is a sentence-transformers model with a Pooling module."""
    return any(m.get("type") == _POOLING_MODULE for m in _modules(Path(model_dir)))


def resolve_task(task: str, model_dir: str) -> str:
    """The task to run, "generate" or "embed": `task`, or for "auto" the checkpoint's."""
    if task != "auto":
        return task
    return "embed" if has_pooling_config(model_dir) else "generate"


def load_pooling_config(model_dir: str, hf_config=None) -> PoolingConfig:
    """The checkpoint's pooling; without sentence-transformers files, vLLM's default for
    decoder embedders: the last token, normalised. Raises ValueError for a pooling mode
    that is not supported."""
    root = Path(model_dir)
    modules = _modules(root)
    matryoshka, dims = _matryoshka(root, hf_config)
    pooling = [m for m in modules if m.get("type") == _POOLING_MODULE]
    if not pooling:
        return PoolingConfig(matryoshka=matryoshka, matryoshka_dimensions=dims)
    return PoolingConfig(
        mode=_pooling_mode(root, pooling[0]),
        normalize=any(m.get("type") == _NORMALIZE_MODULE for m in modules),
        matryoshka=matryoshka,
        matryoshka_dimensions=dims,
    )
