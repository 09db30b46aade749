"""The techniques a pipeline stage's ledger (cost_models/pipeline_rank_memory.py) prices the way the pp = 1 ledger
(cost_models/memory.py) does, per microbatch and per stage, with the pp = 1 path's own functions.

- MoE: a sparse block's saved tensors (router, routed rows) are already in activations.block_bytes_per_token; what a
  stage's block backward adds is the MoE MLP's own moments (cost_models/moe.py backward_moments: un-permuting, the
  experts' activation backward, the up projection's with every routed expert's weight gradient, the second norm's),
  where a dense MLP has one (fc2's). The attention's moment then holds the whole MoE MLP's gradients.
- selective-op checkpointing (torchtitan's op-level policy): every block checkpointed, keeping its input and the
  policy's saved outputs (activations.selective_op_held_bytes_per_token) between its forward and its backward.
Not priced here (refused or noted by the caller): CPU offload (cost_models/mesh_rules.py refuses it with pp > 1),
LoRA (refused with a mesh), the FP8 all-gather and the compiled loss (see pipeline_estimate's notes).
"""

from __future__ import annotations

from . import activations, moe
from .identity_memo import IdentityMemo
from .specs import FsdpConfig, ModelSpec


def checkpoint_policy(model: ModelSpec, c: int, config: FsdpConfig, seq_len: int, ac_every: int,
                      ckpt_bytes_per_token: int) -> tuple[int, int]:
    """(checkpoint every k-th block, what a checkpointed block keeps per token): selective-op checkpoints every
    block and keeps the policy's saved outputs besides its input (memory.py's K = 1 and ckpt)."""
    if not config.selective_op_ac:
        return ac_every, ckpt_bytes_per_token
    return 1, activations.selective_op_held_bytes_per_token(model, c, config.attention, seq_len)


def mlp_moment(model: ModelSpec, c: int, tokens: int, seq_len: int, block_params: int, recomputed: bool,
               base_bytes: int, dense: tuple[int, int]) -> tuple[int, int]:
    """A block's MLP backward at its largest: (activation bytes relative to the stage's held state, weight-gradient
    bytes of the block alive then). dense: the dense MLP's moment, returned for a dense model."""
    if model.moe is None:
        return dense
    terms = _MLP_TERMS.get(model, (c, tokens, seq_len, block_params, recomputed), lambda: tuple(
        (round(m.activation_bytes(tokens, seq_len)), min(m.grad_bytes, block_params * c))
        for m in moe.backward_moments(model, c, recomputed=recomputed)))
    return max(((base_bytes + activation_bytes, grad_bytes) for activation_bytes, grad_bytes in terms), key=sum)


# (model, c, tokens, s, block params, recomputed) -> each MLP moment's (activation, gradient) bytes: a stage's pieces
# ask for every block (~10,000 times in a DeepSeek-V2-Lite search's pipeline scouts)
_MLP_TERMS = IdentityMemo(limit=256)


def attention_grad_bytes(model: ModelSpec, c: int, block_params: int, dense: int) -> int:
    """The block's weight gradients at its attention's backward: the whole MLP's (a MoE MLP's every expert, router
    and shared expert, as memory.py counts them) and the o-projection's."""
    if model.moe is None:
        return dense
    return min(block_params, moe.mlp_param_elements(model) + model.q_dim * model.hidden_size) * c


def recompute_input_bytes_per_token(model: ModelSpec, c: int, config: FsdpConfig, ckpt_bytes_per_token: int) -> int:
    """What a recomputed block holds per token besides its recomputed saved tensors: its checkpointed input. Under
    selective-op the policy's cached outputs are handed back to the recompute as its own tensors, so only the input
    is extra (the pipeline trace, llama-8 GPipe pp2 m4: counting the cache twice priced stage 0 +1.50%)."""
    return c * model.hidden_size if config.selective_op_ac else ckpt_bytes_per_token


def moe_notes(model: ModelSpec) -> tuple[str, ...]:
    """What a stage's MoE pricing leaves out, said in the estimate (the pp = 1 ledger counts it; the stacked experts'
    dim-0 padding is counted, StagePieces.block_padding)."""
    if model.moe is None or not model.n_dense_layers:
        return ()
    return (f"pp > 1 prices {model.name}'s {model.n_dense_layers} dense blocks as sparse ones (their parameters, "
            "saved tensors and moments): an over-estimate of the stages that hold them",)


def loss_bytes(model: ModelSpec, c: int, tokens: int, compiled: bool, parallel: bool = False) -> tuple[int, int]:
    """One microbatch's loss on the last stage, beside its logits (kept in output_chunks, counted by the caller):
    (what stays saved from its forward to its backward, what its backward adds above that). Eager: log_softmax's fp32
    output, then the NLL's and log_softmax's fp32 gradients (loss_memory.loss_events); parallel (loss parallel under
    TP, `model` the rank's vocab / tp): its backward's three fp32 tensors beside the saved output
    (loss_memory.loss_parallel_events). Compiled (one kernel each way): it saves the logits themselves - the stage
    output already counted - and a per-row statistic, and its backward writes the logits' gradient in their dtype
    (loss_events' 2c per logit, less the logits)."""
    _, total = activations.logits_bytes_per_token(model, c, compiled, parallel)
    if compiled:
        return 0, tokens * (total - c * model.vocab_size)
    saved = tokens * 4 * model.vocab_size
    return saved, tokens * total - saved
