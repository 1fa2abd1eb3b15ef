"""Qwen3.5's multi-token-prediction (MTP) block, the `mtp.*` weights of its checkpoints: a
one-layer drafter for speculative decoding (engine/drafter_mtp.py).

For the token t+1 and the target's hidden state at position t it predicts the token t+2:
`norm(layer(fc([pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)])))`, then the
target's own LM head. The embedding and the head are the target's (shared, not loaded twice).
The hidden state is the target's final one, after its last norm: the model's output, as vLLM
feeds its Qwen3.5 / Qwen3-Next MTP (the concatenation puts the embedding first). The layer is
one full-attention decoder layer of the target's kind (gated attention, and the dense MLP or the
MoE block) with its own paged KV, at the positions of the hidden states it reads. For k > 1
drafts it is applied to its own output hidden state.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from axon.distributed.parallel_state import get_tp_size
from axon.layers.linear import ReplicatedLinear
from axon.layers.norm import RMSNorm


def mtp_layer_count(text_config) -> int:
    """The MTP layers a config announces (`mtp_num_hidden_layers`, 0 when absent)."""
    return int(getattr(text_config, "mtp_num_hidden_layers", 0) or 0)


class Qwen3_5MultiTokenPredictor(nn.Module):
    """The `mtp.*` block: `fc`, the two pre-fc norms, `layers.0` and `norm` (zero-centred
    RMSNorms, as every Qwen3.5 norm outside the GDN mixer)."""

    def __init__(self, text_config, layer_cls: type[nn.Module], model_name: str = "the model"):
        super().__init__()
        count = mtp_layer_count(text_config)
        if count != 1:
            raise ValueError(
                f"speculative_config.method mtp needs the model's MTP block, and {model_name} "
                + (
                    "has none (its config's mtp_num_hidden_layers is 0 or absent)"
                    if count == 0
                    else f"has {count} MTP layers (mtp_num_hidden_layers); axon drafts with one"
                )
            )
        if get_tp_size() > 1:  # the drafter runs the block on rank 0 alone
            raise ValueError(
                "speculative_config.method mtp is not available with tensor_parallel_size > 1 "
                "(the MTP block runs unsharded on one rank); use ngram or draft_model"
            )
        size, eps = text_config.hidden_size, text_config.rms_norm_eps
        layer_config = copy.copy(text_config)
        layer_config.layer_types = ["full_attention"]  # the MTP layer always attends in full
        self.fc = ReplicatedLinear(2 * size, size)
        self.pre_fc_norm_embedding = RMSNorm(size, eps, unit_offset=True)
        self.pre_fc_norm_hidden = RMSNorm(size, eps, unit_offset=True)
        self.layers = nn.ModuleList([layer_cls(layer_config, 0)])
        self.norm = RMSNorm(size, eps, unit_offset=True)

    @property
    def attention(self):
        """The layer's paged attention (its KV cache is bound by the drafter)."""
        return self.layers[0].self_attn.attn

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The next hidden states [T, hidden] (after `norm`: the LM head's input, and the
        hidden state of the next draft) from the embeddings of tokens t+1 [T, hidden] and the
        hidden states at t [T, hidden], at positions t [T]."""
        joined = torch.cat(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1
        )
        return self.norm(self.layers[0](positions, self.fc(joined)))
