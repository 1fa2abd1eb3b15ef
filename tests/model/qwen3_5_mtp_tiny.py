"""Tiny Qwen3.5 and Qwen3.5-MoE checkpoints with an `mtp.*` block, and an independent reference
of the block composed from transformers' own Qwen3.5 modules (its decoder layer, RMSNorm and
rotary embedding) with the same weights.

transformers drops `mtp.*` when it loads a checkpoint, so the reference block is built here: a
full-attention decoder layer of the target's kind and the `fc` / pre-fc norms / final norm that
released checkpoints name (`mtp.fc.weight`, `mtp.pre_fc_norm_embedding.weight`,
`mtp.pre_fc_norm_hidden.weight`, `mtp.layers.0.*`, `mtp.norm.weight`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

from tests.model.qwen3_5_tiny import build_qwen3_5, write_qwen3_5
from tests.model.test_moe import build_moe, write_moe
from tests.model.tiny_models import TinyModel

MTP_ARCHS = ("qwen3_5_text", "qwen3_5_moe_text")


class ReferenceMtp(nn.Module):
    """The MTP block from transformers' modules: embed(t+1) and the target's final hidden state
    at t, each normed, concatenated (embedding first), `fc`, one full-attention layer (causal,
    eager), `norm`; the target's LM head gives the logits."""

    def __init__(self, target):
        super().__init__()
        config = copy.deepcopy(target.config)
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        config._attn_implementation = "eager"
        size, eps = config.hidden_size, config.rms_norm_eps
        moe = getattr(config, "num_experts", 0)
        layer_cls = Qwen3_5MoeDecoderLayer if moe else Qwen3_5DecoderLayer
        self.fc = nn.Linear(2 * size, size, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(size, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(size, eps)
        self.layers = nn.ModuleList([layer_cls(config, 0)])
        self.norm = Qwen3_5RMSNorm(size, eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(config)
        self.target = [target]  # not a submodule: its weights are not the block's

    @torch.no_grad()
    def forward(self, next_tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Outputs [T, hidden] for rows 0..T-1: tokens t+1 and the hidden states at t."""
        target = self.target[0]
        embeds = target.model.embed_tokens(torch.tensor([next_tokens]))  # [1, T, H]
        joined = torch.cat(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden[None])], dim=-1
        )
        x = self.fc(joined)
        length = x.shape[1]
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        x = self.layers[0](x, self.rotary(x, positions), attention_mask=mask)
        return self.norm(x)[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k greedy drafts after `tokens`, recomputed from scratch: the target's hidden
        states of every token but the last, then the block on its own outputs."""
        target = self.target[0]
        hidden = target.model(torch.tensor([tokens])).last_hidden_state[0, :-1]  # [n-1, H]
        nexts, drafts = list(tokens[1:]), []
        for _ in range(k):
            out = self(nexts, hidden)
            token = int(target.lm_head(out[-1]).argmax())
            drafts.append(token)
            nexts.append(token)
            hidden = torch.cat([hidden, out[-1:]])
        return drafts

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        skip = ("rotary.",)
        return {
            f"mtp.{name}": t.contiguous()
            for name, t in self.state_dict().items()
            if not name.startswith(skip)
        }


@torch.no_grad()
def build_reference(target, seed: int = 99) -> ReferenceMtp:
    torch.manual_seed(seed)
    mtp = ReferenceMtp(target).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in mtp.named_parameters():
        if "norm" in name:  # zero-centred: (1 + w) vs w must matter
            param.add_(torch.randn(param.shape, generator=generator) * 0.2)
        elif name == "fc.weight" or ".mlp.experts." in name or name.endswith("mlp.gate.weight"):
            # The MoE block's experts and router start uninitialised (torch.empty) outside
            # a transformers model's init.
            param.normal_(0, 0.2, generator=generator)
    return mtp


_CACHE: dict[tuple[str, Path, bool], tuple[TinyModel, ReferenceMtp]] = {}


def get_mtp_model(arch: str, root: Path, with_weights: bool = True):
    """(a tiny checkpoint of `arch` with an MTP block, its reference block). Without
    `with_weights` the config announces the block but the checkpoint lacks its tensors."""
    key = (arch, root, with_weights)
    if key not in _CACHE:
        if arch == "qwen3_5_text":
            target = build_qwen3_5(arch)
        else:
            target = build_moe(arch)
        reference = build_reference(target)
        path = root / f"mtp-{arch}-{'full' if with_weights else 'bare'}"
        if arch == "qwen3_5_text":
            write_qwen3_5(target, path)
        else:
            write_moe(target, path, fused=False)
        if with_weights:
            file = path / "model.safetensors"
            tensors = {**load_file(str(file)), **reference.checkpoint_tensors()}
            save_file(tensors, str(file), metadata={"format": "pt"})
        config_file = path / "config.json"
        config = json.loads(config_file.read_text())
        config["mtp_num_hidden_layers"] = 1
        config_file.write_text(json.dumps(config, indent=2))
        _CACHE[key] = (TinyModel(arch=arch, path=path, hf_model=target), reference)
    return _CACHE[key]
