"""The step walk's events under LoRA and QLoRA at pp = 1 (step_allocations._LoraStepWalk runs these in place of
StepWalk's own): peft's adapters trained inside their block's FSDP2 unit, the base frozen, as memory.py prices them.

- parameters: a block's unit holds its base tensors (stored in the compute dtype under mixed precision:
  memory_shape.LedgerShape.frozen_p) and its adapters' lora_A (r x in) and lora_B (out x r) per target
  (ModelSpec.lora_shapes), stored in the parameter dtype; the root (embedding, final norm, head) frozen. QLoRA
  (qlora.py): the block's linears packed, half a byte a weight, sharded and gathered so, and every linear's
  QuantState on every rank;
- all-gathers: the copy-in source is the shards stored in another dtype than the compute dtype, cast
  (fsdp2_gathers.copy_in_bytes: at bf16 the adapters only, at fp32 none), not the whole unit;
- gradients, reduce-scatter, Adam's states and the optimizer's temporaries: the adapters' only. The root has none,
  so its post-backward reshards and returns before foreach_reduce (torch 2.13 _fsdp_param_group.py post_backward:
  `if len(fsdp_params_with_grad) == 0: return`), and the loss's backward leaves no head gradient;
- activations: the ledger's LoRA shape (memory_shape.ledger_shape: what the adapters save, block 0's first norm
  saving nothing without checkpointing, the backward's working sets with lora=True, the dropout's tensors); a block's
  backward moment is the ledger's (the MLP's where its working set is the larger, with the down projection's
  adapter gradients under all-linear, else the attention's with every adapter gradient; QLoRA's with the weight in
  flight dequantized; all-linear on an MoE: the largest of moe_lora.backward_moments, W_eff's stack-sized gradient a
  tensor beside its working set, no adapter gradient yet), and QLoRA dequantizes each linear's weight in its
  forward, one at a time.
Not written: QLoRA's forward / recompute moment of the MLP's output projection (the ledger's, where it leads the
walk is below it: docs/accuracy.md). A loss kernel (Liger's, the chunked loss) writes its tensors without the frozen
head's weight gradient (loss_kernel_events, head_grad=False). Edge units: lora_edge_events.py. Not here (replays
keeps the flat rule): FSDP1's adapter units (fsdp1_adapters.py); TP / CP / PP with LoRA are not planned.
"""

from __future__ import annotations

import math

from . import optimizer_step, qlora
from .fsdp2_gathers import copy_in_bytes
from .loss_kernel_events import loss_kernel_events
from .memory_shape import ledger_shape
from .pipeline_allocations import ALL_GATHER_STREAM, _RankWalk, param_tensors


def lora_flat_reason(model, training, adapter_units: bool) -> str | None:
    """Why a LoRA / QLoRA step keeps the flat rule (step_allocations.replays), or None (not LoRA, or walked here)."""
    if not training.finetune.adapters:
        return None
    if adapter_units:
        return "LoRA's adapters as FSDP1 units of their own"
    return None


class LoraWalk:
    """The hooks of StepWalk that change under LoRA (a mixin ahead of it)."""

    def _units(self, x) -> list[list[int]]:
        """The root as one frozen tensor, then each block's base tensors and its adapters' (trainable from n_base)."""
        r = self.training.lora_rank
        adapters = self.model.lora_tensor_elements(r)
        base = param_tensors(self.model, x.block_params - sum(adapters))
        self.n_base = len(base)
        # QLoRA: the block's linears (param_tensors' first: q, k, v, o, then the MLP's) packed in 4 bits
        self.packed = set(range(len(qlora.linear_shapes(self.model)))) if self.training.quantized else set()
        root = x.params - x.stage.n_blocks * x.block_params
        return ([[root]] if root else []) + [base + adapters] * x.stage.n_blocks

    def __init__(self, model, training, config, d: int, rank: int):
        self.shape = shape = ledger_shape(model, training, config, None, False)  # (LoraDenseBlocksWalk reads it too)
        self.frozen_p = shape.frozen_p  # read by alloc as _RankWalk's __init__ writes the parameters' shards
        super().__init__(model, training, config, d, rank)
        for j, (i, o) in enumerate(qlora.linear_shapes(model) * model.n_layers if self.packed else ()):
            # each linear's QuantState, on every rank (not an FSDP parameter), kept
            self.alloc(("quant_state", j), qlora.quant_state_bytes(i * o, training.double_quant))
        if self.loss_kernel:  # Liger's / the chunked loss's tensors without the frozen head's weight gradient
            self.loss_events = loss_kernel_events(model, self.c, config, self.tokens, head_grad=False)
        tokens = self.tokens  # block 0's first norm saves nothing (its input needs no gradient): first_less
        self.pieces[self.stage] = self.pieces[self.stage].with_ledger_saved(shape, tokens, shape.first_less)
        # the checkpoint-held inputs as the ledger holds them (the formulas' rotary tables and eager mask, which StepWalk
        # makes the same; a generic family's block traced under LoRA: its own, Llama 4's chunked mask: memory_shape.py)
        self.shared, self.mask = shape.shared, 0
        # each block's backward moment as memory.py picks it (by activations): the MLP's or the attention's, per
        # token and in whole tensors beside them (QLoRA: the linear in flight dequantized, qlora.py)
        mlp, attn = (shape.w_mlp, []), (shape.w_attn - shape.freed_attn, [])
        if self.packed:
            h, f, c, dq = model.hidden_size, model.ffn_hidden_size, self.c, training.double_quant
            dequantized = [f * h * c, max(qlora.absmax_dequantized_bytes(f * h, dq), tokens * f * c)]
            if tokens * h * c + sum(dequantized) > tokens * shape.w_mlp:  # the output projection's backward
                mlp = (h * c, dequantized)
            attn = (attn[0], [qlora.dequantized_attention_bytes(model, c)])
        mlp_grad = shape.mlp_grad
        if model.lora_moe:  # all-linear on an MoE: the ledger's largest MLP moment, W_eff's gradient a tensor beside it
            m = max(shape.mlp_moments[False], key=lambda m: m.activation_bytes(tokens, training.seq_len))
            mlp, mlp_grad = (m.per_token, [m.const_bytes] if m.const_bytes > 0 else []), 0
        mlp_first = tokens * mlp[0] + sum(mlp[1]) >= tokens * attn[0] + sum(attn[1])
        self.moment = (*mlp, mlp_grad) if mlp_first else (*attn, shape.attn_grad)

    def templated(self, x, j: int) -> bool:
        return False  # the adapters' tensors are not tp_block_events' (full fine-tuning's block): the ledger's shape

    def trainable(self, s: int, u) -> list[int]:
        """Unit u's trainable tensors (indexes): a block's adapters, none of the root's."""
        return list(range(self.n_base, len(self.units[s][u]))) if u >= self.root_units(s) else []

    def stored_width(self, s: int, u, i: int) -> int | None:
        """Bytes an element of unit u's tensor i is stored in: the frozen root's and base weights' frozen_p (None:
        QLoRA's packed weights, gathered as stored), the adapters' the param dtype."""
        if u >= self.root_units(s) and i in self.trainable(s, u):
            return self.p
        return None if u >= self.root_units(s) and i in self.packed else self.frozen_p

    def alloc(self, key, size_bytes: int, stream=0) -> None:
        if key[0] == "param" and key[3] not in self.trainable(key[1], key[2]):  # a frozen shard: frozen_p bytes
            size_bytes = math.ceil(self.stored(key[1], key[2], key[3], self.frozen_p) / self.d)
        super().alloc(key, size_bytes, stream)

    def stored(self, s: int, u, i: int, width: int) -> int:
        """Bytes of unit u's tensor i at `width` bytes an element: half a byte where QLoRA packs it."""
        n = self.units[s][u][i]
        return qlora.packed_bytes(n) if u >= self.root_units(s) and i in self.packed else n * width

    def unsharded(self, s: int, u) -> list[int]:
        """QLoRA: a block's all-gather output holds its linears packed (memory.py's block_c), the rest in c."""
        if not self.packed or isinstance(u, str) or u < self.root_units(s):
            return super().unsharded(s, u)
        return [self.stored(s, u, i, self.c) for i in range(len(self.units[s][u]))]

    def all_gather(self, u) -> None:
        """The copy-in source (what is cast to the compute dtype), the all-gather output on the copy-in stream."""
        s = self.stage
        trained, frozen = self.gathered_elements(s, u)
        self.alloc(("all_gather_in", s, u), copy_in_bytes(trained, frozen, self.p, self.frozen_p, self.c, self.d))
        self.alloc(("all_gather", s, u), sum(self.unsharded(s, u)), ALL_GATHER_STREAM)
        self.free(("all_gather_in", s, u))
        self.prefetched.add(u)

    def gathered_elements(self, s: int, u) -> tuple[int, int]:
        """Unit u's trained and frozen elements, the all-gather's copy-in source (lora_edge_events' edge units and
        lora_expert_unit_events' experts: all frozen)."""
        unit = self.units[s][u]
        trained = sum(unit[i] for i in self.trainable(s, u))
        return trained, sum(unit) - trained

    def post_forward(self, s: int, u: int) -> None:
        """QLoRA: each linear's weight dequantized in its forward, one at a time, beside the nested absmax dequantized
        and offset (qlora.forward_in_flight_bytes without the output, which the block's saved tensors hold); then
        the unit's post-forward."""
        if self.packed and u >= self.root_units(s):
            c, dq = self.c, self.training.double_quant
            for i, o in qlora.linear_shapes(self.model):
                absmax = qlora.absmax_dequantized_bytes(i * o, dq)
                _RankWalk.transient(self, ("dequantized", s, u, i, o), [absmax] * 2 * bool(absmax) + [i * o * c])
        super().post_forward(s, u)

    def transient(self, key, sizes, stream=0) -> None:
        """A block's backward working set beside the adapter gradients of its moment (made before it, the down
        projection's first), the rest of them made at its post-backward."""
        if key[0] != "backward":
            return _RankWalk.transient(self, key, sizes, stream)
        s, j = key[1], key[3]
        u = self.root_units(s) + j
        working, dequantized, left = self.moment
        early = []
        for i in reversed(self.trainable(s, u)):
            if self.units[s][u][i] * self.c <= left:
                early.append(i)
                left -= self.units[s][u][i] * self.c
        for i in early:
            self.alloc(("wgrad", s, u, i), self.units[s][u][i] * self.c)
        # the incoming gradient (the working set's c*h) is the walk's grad_in, alive already; eager attention's (s, s)
        # gradients cut first (score_events: StepWalk.transient, which writes it under full fine-tuning, is skipped)
        with self.softmax_backward(key):
            _RankWalk.transient(self, key, self.tensors(max(0, working - self.hs)) + dequantized, stream)
        self.made[u] = set(early)

    def weight_grads(self, s: int, u: int, made: bool = False) -> None:
        """The post-backward: the adapters' gradients not made yet, reshard, reduce-scatter them (a frozen unit:
        reshard only)."""
        early, trained = self.made.pop(u, ()), self.trainable(s, u)
        for i in trained:
            if i not in early:
                self.alloc(("wgrad", s, u, i), self.units[s][u][i] * self.c)
        self.reshard_unit(u)
        if trained:
            self.reduce_scatter(s, u, sum(self.units[s][u][i] for i in trained),
                                [("wgrad", s, u, i) for i in trained])

    def loss(self, events, s: int, mb: int) -> None:
        """The loss's tensors (a loss kernel's: kernel_loss); the frozen head leaves no gradient (edge units: StepWalk's
        head unit hooks, lora_edge_events.py's frozen)."""
        if self.edges:
            return super().loss(events, s, mb)
        if self.loss_kernel:
            self.kernel_loss(events, s, mb)
        else:
            self.model_loss(events, s, mb)

    def root_backward(self, s: int, grad_in) -> None:
        """Autograd ends at block 0 (the embedding's output needs no gradient): its all-gather output, the mask and
        grad_in go, then the root's post-backward (the final callback) reshards it (edge units: StepWalk's
        edge_embedding_backward hook, lora_edge_events.py's frozen)."""
        if self.edges:
            return super().root_backward(s, grad_in)
        if self.pending is not None:
            self.free(self.pending)
            self.pending = None
        self.free(("mask", grad_in[2]))
        self.free(grad_in)
        if self.root_units(s):
            self.weight_grads(s, 0)

    def optimizer_step(self, first: bool) -> None:
        """Adam's states (made at the first step) and the step's temporaries for the adapters' shards, the sharded
        gradients dropped."""
        config, training, s = self.config, self.training, self.stage
        shards = [(u, i, self.units[s][u][i]) for u in range(len(self.units[s])) for i in self.trainable(s, u)]
        total = sum(n for *_, n in shards)
        per_param = training.optimizer.state_bytes_per_param(config.precision.param_dtype)
        n_states = 2 if per_param >= 2 * self.p else 1  # AdamW's exp_avg and exp_avg_sq, each a tensor
        for u, i, n in shards if first else ():
            for k in range(n_states):
                self.alloc(("state", s, u, i, k), math.ceil(n * per_param / n_states / self.d))
        temporaries = optimizer_step.step_temporary_bytes(self.model, training, config.precision, self.d, total)
        self.transient(("optimizer", first), [temporaries * n // total for *_, n in shards])
        for u in {u for u, *_ in shards}:
            self.free(("sharded_grad", s, u))
