"""Eager attention's (s, s) tensors in the pp = 1 step walk (a mixin ahead of step_walk.StepWalk in both of
step_allocations' walks; issue 27 item 1).

transformers' eager attention (eager_attention_forward, models/llama/modeling_llama.py 4.57; Gemma 2's soft-capping,
DeepSeek's MLA alike) makes the scores, each elementwise op on them (scaling, soft-capping, the mask), the softmax and
its cast back as tensors of heads x s x s per sequence, and the softmax's backward its gradients as two more. The walk
cut a block's bytes into the model's widths (f, q, kv, h) with these left in one remainder tensor; the trace makes
and frees them one by one, so the walk's segments were other sizes (a 100 MiB remainder that no 64 MiB segment
holds: +26.9% over the trace's replay on llama4's NO_SHARD fp32 full-AC LoRA row). Here, at the ledger's bytes:
- a block's saved bytes (and its recompute) are cut into the (s, s) tensors it saves first (activations._probs_bytes:
  the softmax output, Gemma 2's tanh output, the fp32 softmax's cast back or dropout's mask and dropped probabilities);
- each block's forward (a checkpointed block's no-grad one too) makes, before its softmax output, two compute-dtype
  scores (an elementwise op's input and output; the first freed as the second is made) and, for an fp32 softmax on
  bf16 scores, their fp32 copy (aten/src/ATen/native/SoftMax.cpp softmax(): input_.toType(dtype) but for a CUDA Half
  input, half_to_float); the last scores and the copy are freed once the softmax output (the first tensor cut) is
  made. Not in the ledger: that moment is below the block's backward moments, which hold the same saved tensors and
  two (s, s) gradients. The recompute's softmax is not written: the backward's working set follows it;
- the softmax backward's working set is cut into its two softmax-dtype gradients first; where the softmax is fp32 and
  its cast back saved, that copy is freed first (activations_backward: "both fp32 ..., whose cast-back copy of the
  probabilities is freed by then"), so the working set is its bytes + the copy's, as two fp32 gradients (those of
  them that fit: the ledger's moment is net of what the block freed before it, the MLP's saved tensors, which the walk
  keeps to the block's end). Under LoRA (LoraWalk.transient) and in a sparse block whose experts are a unit of their
  own (the "block backward" moment after the experts') too, through softmax_backward; the MoE MLP's saved tensors and
  its moment with the experts gathered cut no (s, s) tensor (without_scores). The trace's order, gemma2 LoRA and
  Mixtral with expert units: tests/unit/test_score_events.py.
- attention sinks (gpt-oss; activations_sinks.sink_score_widths): the trace's chain of five tensors (three (s, s), two
  (s, s + 1)) before the softmax output, in each forward and (unlike the other families, not measured there) each
  recompute; its softmax backward lent the block's tensors cut after the softmax output, which the trace's MLP and
  o-projection backward have freed by then. A traced profile's experts-backward moment (expert_unit_events) is cut
  as a softmax backward too. docs/accuracy.md "2026-12-08: gpt-oss's sinks' score tensors".
"""

from __future__ import annotations

from contextlib import contextmanager

from .activations import _attention_dropout, _softmax_bytes, uses_s2_attention
from .activations_mla import is_latent
from .activations_sinks import has_sinks, sink_score_widths
from .specs import ModelSpec


def score_widths(model: ModelSpec, compute_dtype_bytes: int, attention, seq_len: int,
                 fp16: bool = False) -> tuple[list[int], list[int], list[int], int, dict]:
    """Bytes per token of the rank of eager attention's (s, s) tensors: (saved: what a block keeps, largest first;
    working: the softmax backward's two gradients; held: the forward's tensors up to its softmax output; cast: the
    saved cast back the softmax backward frees first, 0 if none; held_frees: a held tensor's index -> the held one
    freed as it is made, the rest freed once the softmax output is made). All empty / 0 without (s, s) scores and
    for a traced block profile (its bytes measured, not composed; gpt-oss EP 4 on 32 read -8.9% -> -23.8% against the
    trace's replay with these widths), but for attention sinks (gpt-oss's s x (s + 1) scores, its profile's or not:
    activations_sinks.sink_score_widths, the trace's ops)."""
    if not uses_s2_attention(model, attention):
        return [], [], [], 0, {}
    if has_sinks(model):
        saved, working, held, held_frees = sink_score_widths(model, compute_dtype_bytes, seq_len)
        return saved, working, held, 0, held_frees
    if model.activation_profile is not None:
        return [], [], [], 0, {}
    c, scores = compute_dtype_bytes, model.n_heads * seq_len
    soft = 4 if is_latent(model) else _softmax_bytes(model, c)   # MLA's softmax is fp32 always
    dropout = _attention_dropout(model)
    saved = [soft] + [c] * bool(model.attn_softcap) + ([c, 1] if dropout else [c] * (soft != c))
    held = [c, c] + [soft] * (soft != c and not fp16)
    cast = c if soft != c and not dropout else 0
    return [w * scores for w in saved], [soft * scores] * 2, [w * scores for w in held], cast * scores, {1: 0}


class EagerScoresWalk:
    """StepWalk with eager attention's (s, s) tensors as tensors of their own (module docstring)."""

    # per token: scores_saved, scores_working (score_widths' lists), scores_cast and scores_lend (bytes per token
    # tensors() adds: the cast back freed before the softmax backward); scores_held_bytes: bytes
    scores_open = None        # (kind, s, j, t) of a block's softmax output while its forward runs (_softmax_output)
    scores_lend = 0
    scores_backward = False   # tensors() cuts StepWalk.transient's backward working set: its (s, s) gradients first
    scores_none = False       # tensors() cuts no (s, s) tensor (without_scores)
    scores_recompute = False  # sinks alone: a recompute makes the forward's scores chain; the softmax backward is
                              # lent what the block freed before it (_freed_before_softmax_backward)
    scores_recomputed = None  # ("recompute", s, mb, j) whose chain is written

    def __init__(self, model, training, config, d: int, rank: int):
        super().__init__(model, training, config, d, rank)
        self.scores_saved, self.scores_working, held, self.scores_cast, self.scores_held_frees = score_widths(
            model, self.c, config.attention, training.seq_len, config.precision.compute_dtype == "fp16")
        self.scores_held_bytes = [self.tokens * w for w in held]
        # the trace's recompute makes the chain again (gpt-oss, activations_sinks.sink_score_widths); other families'
        # recomputes are not written so (their walks kept as they were: not measured)
        self.scores_recompute = bool(held) and has_sinks(model)
        # _RankWalk.widths: [f] * 2 or 3, then q, kv, kv, q, h, h: q, k, v and the attention norm's output come first
        k = len(self.widths) - 6
        self.attention_inputs = {k, k + 1, k + 2, k + 4}

    def tensors(self, per_token_bytes: int) -> list[int]:
        """_cut's tensors; a backward working set's with the cast back lent to it (transient); the model's widths
        alone within without_scores."""
        if not self.scores_held_bytes or self.scores_none:
            return super().tensors(per_token_bytes)
        per_token_bytes, self.scores_lend = per_token_bytes + self.scores_lend, 0
        return self._cut(per_token_bytes, self.scores_backward)[0]

    def _cut(self, per_token_bytes: int, working: bool) -> tuple[list[int], int | None]:
        """The (s, s) tensors that fit cut first, then the model's widths as _RankWalk.tensors cuts them; and the
        softmax output's index among them (None: not cut, or a working set). A working set's gradients come first; a
        block's saved (s, s) tensors after its attention's inputs (q, k, v and the attention norm's output, made
        before the scores) and before the rest (the output, the MLP's, the remainder)."""
        left = per_token_bytes
        scores, before, after = [], [], []
        for w in self.scores_working if working else self.scores_saved:
            if w <= left:
                scores.append(w)
                left -= w
        for i, w in enumerate(self.widths):   # pipeline_allocations.cut's rule, each width kept with its place
            if 0 < w <= left:
                (before if i in self.attention_inputs else after).append(w)
                left -= w
        after += [left] * (left > 0)
        if working:
            return [self.tokens * w for w in scores + before + after], None
        # by place, not size: q, k, v or the norm's output can be the softmax output's size (s = head_dim, fp32)
        softmax_at = len(before) if scores and scores[0] == self.scores_saved[0] else None
        return [self.tokens * w for w in before + scores + after], softmax_at

    def pre_forward(self, s: int, u: int) -> None:
        super().pre_forward(s, u)
        j = u - self.root_units(s) if isinstance(u, int) else -1
        x = self.pieces[s]
        if self.scores_held_bytes and 0 <= j < x.stage.n_blocks and not self.templated(x, j):
            t = self._kept(x, j)[1]
            if t is not None:   # the softmax output: the block's first (s, s) tensor
                self.scores_open = ("forward" if x.checkpointed[j] else "saved", s, j, t)

    def _kept(self, x, j: int) -> tuple[list[int], int | None]:
        """Block j's saved tensors (checkpointed: its recompute's; not templated: inputs() cuts them as tensors())
        and its softmax output's index among them."""
        return self._cut(x.block_full if x.checkpointed[j] else x.kept[j], False)

    def alloc(self, key, size_bytes: int, stream=0) -> None:
        opened = self.scores_open is not None and self._softmax_output(key) or self._recomputed_softmax(key, size_bytes)
        if opened:
            for i, size in enumerate(self.scores_held_bytes):
                super().alloc(("scores", key, i), size)   # the scores chain: an op's input freed as its output is made
                if i in self.scores_held_frees:
                    self.free(("scores", key, self.scores_held_frees[i]))
        super().alloc(key, size_bytes, stream)
        if opened:
            self.scores_open = None
            freed = set(self.scores_held_frees.values())
            self.events += [("free", ("scores", key, i)) for i in range(len(self.scores_held_bytes)) if i not in freed]

    def _softmax_output(self, key) -> bool:
        kind, s, j, t = self.scores_open
        if kind == "forward":   # a checkpointed block's forward tensor: ((forward, s, mb, j), t)
            return isinstance(key[0], tuple) and key[0][:2] == (kind, s) and key[0][3] == j and key[1] == t
        return key[0] == kind and key[1] == s and key[3] == j and key[4] == t   # (saved, s, mb, j, t)

    def _recomputed_softmax(self, key, size_bytes: int) -> bool:
        """Whether `key` is a checkpointed block's recomputed softmax output (its first tensor of that size) where the
        recompute's scores are written (attention sinks: scores_recompute)."""
        if not self.scores_recompute or key[0] != "recompute":
            return False
        if key[4] == 0:
            self.scores_recomputed = None
        if self.scores_recomputed == key[:4] or size_bytes != self.tokens * self.scores_saved[0]:
            return False
        self.scores_recomputed = key[:4]
        return True

    def post_forward(self, s: int, u: int) -> None:
        self.scores_open = None
        super().post_forward(s, u)

    def transient(self, key, sizes, stream=0) -> None:
        """A block's backward working set cut into the softmax's two gradients first, its saved cast back freed
        before them (module docstring)."""
        if key[0] != "backward":
            return super().transient(key, sizes, stream)
        with self.softmax_backward(key):
            super().transient(key, sizes, stream)

    @contextmanager
    def without_scores(self):
        """tensors() cut as the model's widths alone: what an MoE MLP saves and its backward moment with the experts
        gathered (expert_unit_events, lora_expert_unit_events) hold no (s, s) tensor, as the trace's do not."""
        self.scores_none = True
        yield
        self.scores_none = False

    @contextmanager
    def softmax_backward(self, key):
        """Around the backward moment `key` ((kind, s, mb, j)) of block j that holds its softmax's backward: its saved
        cast back freed before it, its working set (tensors()) cut into the two gradients first. Entered by this
        transient and by the walks whose own transient writes a block's moments without it (lora_events.LoraWalk,
        expert_unit_events / lora_expert_unit_events: the "block backward" moment after the experts')."""
        if not self.scores_held_bytes:
            yield
            return
        _, s, mb, j = key
        x, lent = self.pieces[s], []
        if self.scores_cast and not self.templated(x, j):
            kept, probs = self._kept(x, j)
            name = "recompute" if x.checkpointed[j] else "saved"
            probs = len(kept) if probs is None else probs
            t = next((t for t in range(probs + 1, len(kept)) if kept[t] == self.tokens * self.scores_cast), None)
            lent = [((name, s, mb, j, t), kept[t])] * (t is not None)
        elif self.scores_recompute and not self.templated(x, j):
            lent = self._freed_before_softmax_backward(x, s, mb, j)
        for lent_key, size in lent:
            self.free(lent_key)
        self.scores_lend = sum(size for _, size in lent) // self.tokens
        self.scores_backward = True
        yield
        self.scores_backward, self.scores_lend = False, 0
        for lent_key, size in lent:   # made again for the walk's own free at the block's end (the ledger's)
            self.alloc(lent_key, size)

    def _freed_before_softmax_backward(self, x, s: int, mb: int, j: int) -> list[tuple[tuple, int]]:
        """Attention sinks: block j's kept tensors cut after its softmax output (the output, the MLP's, the rest),
        which the trace's backward has freed by its softmax backward (the MLP's and the o-projection's backward run
        first); the ledger's moment is net of them (activations_backward), so lent to the working set it holds the
        trace's s x (s + 1) gradients (gpt-oss, s 8,192: the third (s, s + 1) segment of the trace)."""
        name = "recompute" if x.checkpointed[j] else "saved"
        kept = self.recomputed(x, j) if x.checkpointed[j] else self.inputs(x, j)
        probs = self.tokens * self.scores_saved[0]
        if probs not in kept:
            return []
        return [((name, s, mb, j, t), size) for t, size in enumerate(kept) if t > kept.index(probs)]
