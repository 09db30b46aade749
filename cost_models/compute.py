"""FLOPs per token.

Executed FLOPs (Kaplan et al. 2020; PaLM appendix B): 6 per non-embedding parameter per token (forward
2, backward 4) plus attention 12*L*n_heads*head_dim*s (forward + backward, causal masking not
discounted); a tied output head still multiplies by the embedding matrix, so it adds 6*h*V.
MFU uses torchtitan's convention instead (6 per parameter, embeddings included, plus the same attention
term), so our MFU is comparable with the published torchtitan figures. LoRA: frozen weights need no
weight gradient, so their backward is 2 FLOPs per parameter instead of 4; the adapters cost the full 6. Activation checkpointing re-runs the forward (2 per parameter plus
the attention forward) of each checkpointed block; that is hardware FLOPs, not model FLOPs.
Mixture of experts: a token runs through the k experts its router picks, so FLOPs count the active
parameters (ModelSpec.active_params: the experts it skips left out; the router's E x h matmul is among
them) - for MFU too, as torchtitan counts its MoE models. Ignored: norms, activations, softmax, top-k and
the loss (well under 1% for billion-parameter models), grouped_mm's efficiency on small expert batches.
"""

from __future__ import annotations

import math

from . import moe_lora, moe_lora_targets
from .moe import active_block_params
from .operators import block_ops
from .specs import FsdpConfig, ModelSpec, TrainingSpec


def attention_flops_per_token_per_layer(model: ModelSpec, seq_len: int) -> float:
    """Forward + backward of QK^T and PV (torchtitan: 12 * n_heads * head_dim * s per layer)."""
    return 12 * model.q_dim * seq_len


def _training_flops(params: float, model: ModelSpec, training: TrainingSpec) -> float:
    if training.finetune.adapters:
        r, sparse = training.lora_rank, model.n_layers - model.n_dense_layers
        lora = model.lora_params(r)  # the lora.Linear adapters' elements: the router's and stacks' train via W_eff
        if model.lora_moe:  # all-linear on an MoE: the experts' and router's merged weights train (moe_lora.py)
            lora -= sparse * sum(moe_lora_targets.adapter_tensor_elements(model, r))
        matmul = 4 * params + 6 * lora  # frozen weights: forward 2 + input-gradient 2; adapters train (6)
        if model.lora_moe:
            matmul += sparse * moe_lora.trained_flops_per_token(model, r, training.seq_len)
    else:
        matmul = 6 * params
    return matmul + model.n_layers * attention_flops_per_token_per_layer(model, training.seq_len)


def model_flops_per_token(model: ModelSpec, training: TrainingSpec) -> float:
    """FLOPs one training token executes, without recompute."""
    dense_params = model.active_params - model.embedding_params
    if model.tied_embeddings:
        dense_params += model.hidden_size * model.vocab_size
    return _training_flops(dense_params, model, training)


def mfu_flops_per_token(model: ModelSpec, training: TrainingSpec) -> float:
    """The numerator of MFU, torchtitan's convention: every (active) parameter counts 6 FLOPs per token."""
    return _training_flops(model.active_params, model, training)


def recompute_flops_per_token(model: ModelSpec, training: TrainingSpec, config: FsdpConfig) -> float:
    """Extra forward FLOPs per token from activation checkpointing. Selective op-level: every second
    matmul of each block (operators.BlockOps.selective_op_recomputed), the attention kernel's output saved."""
    if config.selective_op_ac:
        ops = block_ops(model, 2, training.seq_len, training.adapter_rank)
        return model.n_layers * sum(m.forward_flops_per_token for m in ops.selective_op_recomputed())
    if not config.ac_every:
        return 0.0
    n_ckpt = math.ceil(model.n_layers / config.ac_every)
    block_forward = 2 * active_block_params(model) + attention_flops_per_token_per_layer(model, training.seq_len) / 3
    return n_ckpt * block_forward
