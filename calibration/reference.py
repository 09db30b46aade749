"""A small, readable Llama-style decoder built from a ModelSpec, in plain torch.

Used when there is no Hugging Face config to build from (calibration, traces, distributed tests). It
follows Hugging Face's LlamaForCausalLM where it matters for memory and FLOPs: RMSNorm before attention
and MLP, rotary embeddings, grouped-query attention, SwiGLU MLP, no biases, and a causal-LM loss on
fp32-upcast logits. Its parameter count equals ModelSpec.n_params exactly (tested).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from calibration.fused_loss import IGNORE_INDEX, shifted_targets
from cost_models.specs import ModelSpec

ROPE_THETA = 10000.0
INIT_STD = 0.02  # Hugging Face's initializer_range for Llama


class CausalLMOutput(NamedTuple):
    """(loss, logits) like Hugging Face's return_dict=False tuple, with .loss/.logits like its ModelOutput."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # Normalise in fp32 and cast back, as Hugging Face does (bf16 variance is too coarse).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(seq_len: int, head_dim: int, device, dtype):
    """cos/sin tables of shape (seq, head_dim), computed in fp32 on every call.

    Deliberately not a buffer: FSDP1 MixedPrecision(buffer_dtype=bf16) would cast a stored inv_freq to
    bf16 and blur positions in long sequences; recomputing costs O(s * head_dim), nothing next to attention.
    """
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.attention = attention
        self.q_proj = nn.Linear(spec.hidden_size, spec.q_dim, bias=False)
        self.k_proj = nn.Linear(spec.hidden_size, spec.kv_dim, bias=False)
        self.v_proj = nn.Linear(spec.hidden_size, spec.kv_dim, bias=False)
        self.o_proj = nn.Linear(spec.q_dim, spec.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        # -1 heads: a tensor-parallel rank's projections hold n_heads / tp (n_kv_heads / tp) of them
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # GQA: each kv head serves n_heads / n_kv_heads query heads (repeated, as Hugging Face does).
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if self.attention == "eager":
            # Explicit scores: stores a (b, heads, s, s) tensor per layer, like HF's eager path.
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            out = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One decoder layer: the repeated unit FSDP wraps (ModelSpec.block_class == "Block")."""

    def __init__(self, spec: ModelSpec, attention: str):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size)
        self.self_attn = Attention(spec, attention)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class ReferenceLlama(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str = "sdpa"):
        super().__init__()
        if attention not in ("sdpa", "eager"):
            raise ValueError(f"attention must be sdpa or eager, got {attention!r}")
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Block(spec, attention) for _ in range(spec.n_layers))
        self.norm = RMSNorm(spec.hidden_size)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Hugging Face's Llama init: N(0, 0.02) for linears and embeddings, ones for norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.device.type != "meta":
                module.weight.normal_(0.0, INIT_STD)

    def forward(self, input_ids, labels=None):
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(input_ids.shape[1], self.spec.head_dim, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        loss = None if labels is None else causal_lm_loss(logits, labels)
        return CausalLMOutput(loss, logits)


def causal_lm_loss(logits, labels):
    """Hugging Face's ForCausalLMLoss: fp32 logits, token t predicts label t+1, -100 ignored, mean. Like
    it, the labels are shifted and padded rather than the logits sliced (no copy of the logits)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), shifted_targets(labels.to(logits.device)),
                           ignore_index=IGNORE_INDEX)


def build_reference(spec: ModelSpec, attention: str = "sdpa") -> nn.Module:
    """ReferenceLlama for a llama-family spec; builds on the current default device (use a
    torch.device context manager for meta)."""
    if spec.family != "llama":
        raise ValueError(f"the reference model implements the llama family only, not {spec.family!r}; "
                         "pass a Hugging Face config for other families")
    return ReferenceLlama(spec, attention)


def llama_param_counts(hidden: int, q_dim: int, kv_dim: int, ffn: int, vocab: int, tied: bool) -> dict:
    """Exact parameter counts of ReferenceLlama (and of Hugging Face's LlamaForCausalLM without biases)."""
    attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden  # q, k, v, o
    mlp = 3 * hidden * ffn                                               # gate, up, down
    return {
        "block_params": attention + mlp + 2 * hidden,  # + two RMSNorm weights
        "embedding_params": vocab * hidden,
        "head_params": 0 if tied else vocab * hidden,
        "root_other_params": hidden,                   # final norm
    }


def tiny_llama_spec(**overrides) -> ModelSpec:
    """A small llama-family ModelSpec (GQA: 4 query heads over 2 kv heads) with exact counts.

    Overrides may change the name, shape fields (n_layers, hidden_size, n_heads, n_kv_heads, head_dim,
    ffn_hidden_size, vocab_size), tied_embeddings and max_seq_len; counts are recomputed from them.
    """
    shape = dict(name="tiny-llama", n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=16,
                 ffn_hidden_size=128, vocab_size=256, tied_embeddings=False, max_seq_len=0)
    unknown = set(overrides) - set(shape)
    if unknown:
        raise ValueError(f"tiny_llama_spec cannot override {sorted(unknown)}; counts follow from the shape")
    shape.update(overrides)
    h, q_dim = shape["hidden_size"], shape["n_heads"] * shape["head_dim"]
    kv_dim = shape["n_kv_heads"] * shape["head_dim"]
    counts = llama_param_counts(h, q_dim, kv_dim, shape["ffn_hidden_size"], shape["vocab_size"],
                                shape["tied_embeddings"])
    return ModelSpec(
        family="llama", block_class="Block", gated_mlp=True, norm="rmsnorm", activation="silu",
        lora_target_shapes=((h, q_dim), (h, kv_dim), (h, kv_dim), (q_dim, h)),  # q, k, v, o as the presets
        **shape, **counts,
    )
