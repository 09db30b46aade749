"""The step walk's events for torchtitan 0.3's edge units (cost_models/edge_units.py says what FSDP2 does with them;
step_walk.StepWalk calls these where the root's hooks run; its reduce_scatter reduces each gradient)."""

from __future__ import annotations


class EdgeUnitsWalk:
    """The embedding's unit ("emb") and [final norm, head]'s ("head") reshard and reduce apart from the blocks; the
    head's and the norm's gradients are reduced one post-backward after the other."""

    def init_edges(self, model, pieces, d: int) -> None:
        """`edges` where the stage's root splits (ModelSpec.split_edge_units, a shard group of more than one rank);
        the units' gathered bytes and the gradients' parameters, keyed by name in place of unit 0's."""
        self.edges = model.split_edge_units and d > 1 and bool(self.root_units(self.stage))
        if self.edges:
            embedding = model.embedding_params
            self.edge_bytes = {"emb": embedding * self.c, "head": pieces.root_gathered - embedding * self.c}
            self.edge_params = {"emb": embedding, "norm": model.root_other_params,
                                "head": self.units[self.stage][0][0] - embedding - model.root_other_params}

    def edge_embedding_forward(self) -> None:
        """The embedding's unit at a microbatch's start: gathered, resharded after its forward unless ZeRO-2."""
        self.unshard("emb")
        if not self.keeps_gathered:
            self.reshard_unit("emb")

    def optimizer_step(self, first: bool) -> None:
        """The rank's optimizer step, then the head unit's sharded gradients dropped too (the embedding's: unit 0's)."""
        super().optimizer_step(first)
        if self.edges:
            self.free(("sharded_grad", self.stage, "head"))
            self.free(("sharded_grad", self.stage, "norm"))

    def edge_head_backward(self, events, s: int) -> None:
        """Edge units: the head's gradient (made inside a loss kernel's forward, else after the loss's backward), its
        unit's post-backward (inside the kernel's loop, as torchtitan's chunked loss reduces it at the last chunk);
        at the loss's backward the final norm's pre-backward gathers the unit again and prefetches the last block,
        then the norm's gradient and the unit's second post-backward (edge_units.py)."""
        if events is self.loss_events[0] and self.loss_kernel or events is self.loss_events[1] and not self.loss_kernel:
            if not self.loss_kernel:
                self.edge_grad(s, "head")
            self.edge_post_backward(s, "head")
        if events is self.loss_events[1]:
            self.unshard("head", backward=True)
            last = len(self.units[s]) - 1
            if last not in self.gathered_units:
                self.all_gather(last)
            self.edge_grad(s, "norm")
            self.edge_post_backward(s, "norm")

    def edge_grad(self, s: int, part: str) -> None:
        """The gradient of `part` (head or norm; lora_edge_events: frozen, none)."""
        self.alloc(("wgrad", s, part, 0), self.edge_params[part] * self.c)

    def edge_embedding_backward(self, s: int, grad_in) -> None:
        """The embedding unit's pre-backward (its prefetched all-gather copied out), its gradient from block 0's input
        gradient (under TP with sequence parallel the whole table first: embedding_table_grad), its post-backward."""
        self.unshard("emb", backward=True)
        if self.pieces[s].grad_extra:
            self.embedding_table_grad(s, grad_in, ("wgrad", s, "emb", 0))
        else:
            self.alloc(("wgrad", s, "emb", 0), self.edge_params["emb"] * self.c)
            self.free(grad_in)
        self.edge_post_backward(s, "emb")

    def edge_post_backward(self, s: int, part: str) -> None:
        """An edge unit's post-backward for the gradient of `part` (emb, head or norm): reshard, then reduce-scatter,
        the one gradient freed once the output is made; the embedding's sharded gradient keyed as unit 0's."""
        self.reshard_unit("emb" if part == "emb" else "head")
        self.reduce_scatter(s, part, self.edge_params[part], [("wgrad", s, part, 0)], kept=True,
                            shard_unit=0 if part == "emb" else part)
