"""TRL 1.16's log-prob head: the bytes its fused head holds beside the model, in place of verl's [tokens, vocab]
logits (rl_actor.verl_logits_bytes).

GRPOTrainer patches the actor (and the reference) with add_fused_lm_head (trl/trainer/utils.py): the forward runs
the backbone, keeps the hidden states of the positions whose label is scored - the completion tokens only
(_get_per_token_logps_and_entropies masks the prompt's labels to -100) - as a compact copy (`hidden_states[mask]`
on a Triton device), and hands them to ChunkedLogProbFunction (trl/kernels/chunked_logprob.py): the projection in
[TOKEN_CHUNK_SIZE, chunk_size] tiles of one buffer (4,096 tokens x 32,768 vocabulary columns, the compute dtype),
folded by a Triton kernel into per-token fp32 statistics (online log-sum-exp, entropy); no [tokens, vocab] tensor.
Its backward recomputes each tile into the same kind of buffer and accumulates the hidden states' gradient and the
head's (when it trains: not with LoRA) in fp32, then casts both to their dtype. The entropy is always computed in
the update (_compute_loss: compute_entropy=True), never in the log-prob passes.

Traced (tests/unit/test_rl_logits_trace.py: TRL's own ChunkedLogProbFunction on fake tensors, its Triton kernels
and CUDA's fp32-output addmm standing in as what they are on a GPU - writes into buffers they are given): forward
only, the tile and 11 fp32 values per token; through the backward, the tile, the hidden states' gradient in fp32
and in its dtype, the head's likewise, and 5 fp32 values per token. Ignored: the [batch, length] outputs
masked_scatter writes back (two fp32 values per position).
"""

from __future__ import annotations

from .model_spec import ModelSpec

TOKEN_TILE = 4096      # trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE
VOCAB_TILE = 32768     # trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE (the chunk_size GRPOTrainer passes)
FORWARD_FP32_PER_TOKEN = 11    # the running statistics, log Z, the log-probs and the entropy (traced)
BACKWARD_FP32_PER_TOKEN = 5    # the saved log Z and entropy, the incoming gradients made contiguous fp32 (traced)


def trl_head_bytes(model: ModelSpec, scored_tokens: int, c: int, grad: bool, head_trains: bool) -> int:
    """The fused head's bytes at its peak on `scored_tokens` completion tokens: the compact hidden states and one
    tile, and the per-token statistics; with grad (the update), at the end of its backward: the hidden states'
    gradient (fp32 and its cast), the head weight's (fp32 and its cast: the unsharded gradient FSDP then reduces)
    when it trains."""
    h, v, n = model.hidden_size, model.vocab_size, scored_tokens
    tile = min(n, TOKEN_TILE) * min(v, VOCAB_TILE) * c
    compact = n * h * c
    if not grad:
        return compact + tile + FORWARD_FP32_PER_TOKEN * n * 4
    return (compact + tile + n * h * (4 + c) + head_trains * v * h * (4 + c) + BACKWARD_FP32_PER_TOKEN * n * 4)
