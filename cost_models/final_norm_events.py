"""The last pipeline stage's final RMSNorm op by op, as torch makes and frees it (a mixin of pipeline_allocations'
composed walk; issue 27 item 1).

The walk held the final norm's saved tensors in the stage's "rest" (one tensor) and wrote no working set; the trace
(calibration.trace_pipeline, torch 2.13, transformers' LlamaRMSNorm under bf16: x.to(float32), pow(2), mean, + eps,
rsqrt, x * rsqrt, .to(bf16), weight * that) makes a 16-bit chain around fp32 tensors of the stage's tokens x h:
- forward: the fp32 input, its square (freed), the statistics, the fp32 product (freed once cast back), the cast and
  the weight's product (the head's input); saved: the fp32 input, rsqrt, the cast, the head's input. The last block's
  output (read by the norm) is freed once the logits are made (the model's locals), before the root's post-forward.
- backward, from the head's input gradient (made after the head's weight gradient): the head's input freed, the
  gradient times the weight and times the cast (the weight's gradient, a sum: counted in the root's gradient), the
  fp32 chain of mul / sum / pow / div / add (tp_block_events._Events.norm_backward's, with no residual to add), the
  fp32 input freed, the input's gradient cast back: the last block's output gradient.
Written where the blocks are (tp_block_events.applies) under a 16-bit compute dtype without TP (traced: the test
config's last stage, benchmarks/pipeline_replay.py's); elsewhere the final norm stays in "rest".
"""

from __future__ import annotations

from functools import lru_cache

from .tp_block_events import BlockEvents, BlockWidths, _Events, keyed

SAVED = ("fn.x32", "fn.rsqrt", "fn.bf", "fn.out")   # what the forward leaves for the backward


@lru_cache(maxsize=16)
def norm_forward(w: BlockWidths) -> BlockEvents:
    """The final norm's forward of the last block's output (not freed here): SAVED left made."""
    e = _Events(w)
    e.norm("fn.", True, "x")
    return BlockEvents(e.events)


@lru_cache(maxsize=16)
def norm_backward(w: BlockWidths) -> BlockEvents:
    """Its backward from the head's input gradient "fn.dy" (made before, freed) to "dx" (left made); SAVED freed."""
    e = _Events(w)
    e.drop("fn.out")
    e.make("fn.a", "S"), e.make("fn.b", "S")
    e.drop("fn.b", "fn.dy", "fn.bf")
    e.make("fn.a32", "S32")
    e.drop("fn.a")
    e.make("fn.m1", "S32"), e.make("fn.m2", "S32"), e.make("fn.s1", "stat")
    e.drop("fn.m1", "fn.a32")
    e.make("fn.p", "stat"), e.make("fn.m3", "stat"), e.make("fn.m4", "stat")
    e.drop("fn.m3", "fn.p", "fn.rsqrt", "fn.s1")
    e.make("fn.d", "S32")
    e.drop("fn.m4")
    e.make("fn.p2", "S32"), e.make("fn.m5", "S32"), e.make("fn.m6", "S32")
    e.drop("fn.m5", "fn.p2", "fn.d", "fn.x32")
    e.make("fn.sum", "S32")
    e.drop("fn.m2", "fn.m6")
    e.make("dx", "S")
    e.drop("fn.sum")
    return BlockEvents(e.events)


class FinalNormWalk:
    """_RankWalk's stage_end, loss and output_grad on a last stage whose final norm is written op by op."""

    held_output = None   # the last block's output, freed once the logits are made

    def final_norm_saved(self, x) -> int:
        """Bytes the final norm saves where it is written op by op (in the stage's rest bytes), else 0."""
        w = self.block
        if not (x.stage.head and x.kept and w is not None and w.tp == 1 and w.c == 2
                and self.templated(x, len(x.kept) - 1)):
            return 0
        saved = sum(e[2] for e in norm_forward(w) if e[0] == "alloc" and e[1] in SAVED)
        return saved if saved <= x.saved - self.tokens * sum(x.kept) - x.output else 0

    def stage_end(self, x, mb: int, out) -> None:
        saved, s = self.final_norm_saved(x), x.stage.index
        if not saved:
            return super().stage_end(x, mb, out)
        self.alloc(("rest", s, mb), x.saved - self.tokens * sum(x.kept) - x.output - saved)
        self.events += keyed(norm_forward(self.block), {n: ("final norm", s, mb, n) for n in SAVED})
        self.held_output = out
        self.loss(self.loss_events[0], s, mb)

    def loss(self, events, s: int, mb: int) -> None:
        """The last block's output freed once the logits are made (StageUnitsWalk's first call: the logits alone);
        the head's input gradient made before the loss's last event frees the logits' gradient."""
        if events and events[-1] is self.loss_events[1][-1] and self.final_norm_saved(self.pieces[s]):
            super().loss(events[:-1], s, mb)
            self.alloc(("final norm", s, mb, "fn.dy"), self.block.stream)
            events = events[-1:]
        super().loss(events, s, mb)
        if self.held_output is not None:
            self.free(self.held_output)
            self.held_output = None

    def output_grad(self, x, mb: int):
        if not self.final_norm_saved(x):
            return super().output_grad(x, mb)
        s, top = x.stage.index, ("grad_in", x.stage.index, mb, x.stage.n_blocks)
        names = {n: ("final norm", s, mb, n) for n in SAVED + ("fn.dy",)} | {"dx": top}
        self.events += keyed(norm_backward(self.block), names)
        return top


__all__ = ["FinalNormWalk", "norm_backward", "norm_forward"]
