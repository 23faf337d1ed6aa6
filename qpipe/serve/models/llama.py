"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM): one decoder, differences read from config.

Weights come from a `WeightSource`, which hands over plain tensors (embeddings, norms) and ready
linear layers by fused name with the checkpoint names they fuse, so the same model class serves HF
checkpoints, compressed-tensors checkpoints and qpipe artifacts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from qpipe.serve.layers.activation import gated_mlp
from qpipe.serve.layers.attention import (
    AttentionMetadata,
    KVScales,
    LayerCache,
    paged_attention,
)
from qpipe.serve.layers.linear import DenseLinear, LinearBase
from qpipe.serve.layers.norm import RMSNorm
from qpipe.serve.layers.rotary import RotaryEmbedding, RotaryTables

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class WeightSource(Protocol):
    def tensor(self, name: str) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...

    def linear(self, name: str, parts: list[str]) -> LinearBase: ...

    def kv_scales(self, attn: str, num_kv_heads: int) -> KVScales | None:
        """The k_scale and v_scale of an attention module whose checkpoint calibrated an fp8 KV
        cache, on the model's device, else None."""
        ...


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, weights: WeightSource, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        eps = config.rms_norm_eps
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        self.input_layernorm = RMSNorm(weights.tensor(f"{prefix}.input_layernorm.weight"), eps)
        self.qkv_proj = weights.linear(
            f"{attn}.qkv_proj", [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"]
        )
        self.o_proj = weights.linear(f"{attn}.o_proj", [f"{attn}.o_proj"])
        self.kv_scales = weights.kv_scales(attn, self.num_kv_heads)
        self.post_attention_layernorm = RMSNorm(
            weights.tensor(f"{prefix}.post_attention_layernorm.weight"), eps
        )
        self.gate_up_proj = weights.linear(
            f"{mlp}.gate_up_proj", [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
        )
        self.down_proj = weights.linear(f"{mlp}.down_proj", [f"{mlp}.down_proj"])

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryTables,
        cache: LayerCache,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream before it): the residual add of each sub-block is
        fused into the norm that follows it. `keep` selects the rows that go on past attention:
        every row's K/V must reach the cache, but in the last layer only the rows that will be
        projected onto the vocabulary need the output projection and the MLP."""
        hidden, residual = self.input_layernorm(hidden, residual)
        qkv = self.qkv_proj(hidden)
        q, k, v = rotary.apply(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, cache, meta, self.scale, self.kv_scales)
        if keep is not None:
            attn, residual = attn[keep], residual[keep]
        hidden, residual = self.post_attention_layernorm(self.o_proj(attn), residual)
        return gated_mlp(self.gate_up_proj, self.down_proj, hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, weights: WeightSource, max_positions: int) -> None:
        super().__init__()
        architectures = getattr(config, "architectures", None) or ["LlamaForCausalLM"]
        if architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {architectures[0]!r} is not served; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.config = config
        # a buffer, so that `.to(device)` moves it; a tied head below shares the same tensor
        self.register_buffer(
            "embed_tokens", weights.tensor("model.embed_tokens.weight"), persistent=False
        )
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, weights, f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(weights.tensor("model.norm.weight"), config.rms_norm_eps)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head: LinearBase = DenseLinear(self.embed_tokens, None)
        elif not weights.has("lm_head"):
            # transformers would start this head from random values, and vLLM refuses it
            raise ValueError(
                "config.json says tie_word_embeddings=false but the weights hold no "
                "lm_head.weight; copy the checkpoint again with its lm_head, or set "
                "tie_word_embeddings: true if the model shares its embeddings with its output"
            )
        else:
            self.lm_head = weights.linear("lm_head", ["lm_head"])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[LayerCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (fp32) for the tokens at `logits_indices` only: the vocabulary projection is the
        biggest GEMM per token, and only each sequence's last token needs it."""
        return self.compute_logits(
            self.final_hidden(input_ids, positions, caches, meta, logits_indices)
        )

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[LayerCache],
        meta: AttentionMetadata,
        indices: torch.Tensor,
    ) -> torch.Tensor:
        """The normalized last hidden states at `indices`, for callers that project them in
        slices (prompt logprobs: one row per prompt token, a [rows, vocab] tensor at once)."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        rotary = self.rotary.tables(hidden, positions)
        residual = None
        *layers, last = zip(self.layers, caches, strict=True)
        for layer, cache in layers:
            hidden, residual = layer(hidden, residual, rotary, cache, meta)
        # a prefill chunk's other rows only feed the caches: the last layer drops them after
        # attention (for 128-token prompts, 3 % of the prefill's arithmetic)
        hidden, residual = last[0](hidden, residual, rotary, last[1], meta, keep=indices)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.float_output(hidden)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
