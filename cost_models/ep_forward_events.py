"""A no-grad MoE MLP forward under expert parallelism as the trace makes it: transformers 5.24's AllToAllEP dispatch
and combine (distributed/expert_parallel.py) around its grouped_mm experts forward (integrations/moe.py), top-1 on the
received rows. Read off memory_accuracy.py --mesh --only ep row 26's trace, each allocation labelled by its aten op
(docs/accuracy.md "2026-12-08: EP's no-grad experts forward ..."); every tensor is in the compute dtype.

Rows: `sent` per token (k: this rank's tokens' (token, expert) pairs), `received` per token (k x the routing
imbalance: the rows this rank's experts run). Widths h (hidden) and f (expert FFN). The plan is a list of
("alloc", name, bytes per token) and ("free", name) in the trace's order."""

from __future__ import annotations


def ep_no_grad_forward_plan(sent: float, received: float, h: int, f: int, c: int) -> list[tuple]:
    """The dispatch, experts and combine of one MoE MLP with no autograd graph (a checkpointed block's forward)."""
    sh, rh, rf = sent * h * c, received * h * c, received * f * c
    return [
        ("alloc", "send", sh),           # expert_parallel.py:219 hidden_states[order // k]
        ("alloc", "recv", rh),           # :226 all_to_all_single_autograd (dispatch)
        ("free", "send"),
        ("alloc", "sorted", rh),         # moe.py:441 hidden_states[perm // num_top_k]
        ("alloc", "gate_up", 2 * rf),    # :489 _grouped_linear (gate | up)
        ("alloc", "gate_up masked", 2 * rf),  # :496 masked_fill (EP's sentinel rows)
        ("free", "gate_up"),
        ("alloc", "act", rf),            # _apply_gate: act_fn(gate)
        ("alloc", "gated", rf),          # act_fn(gate) * up
        ("free", "act"),
        ("free", "gate_up masked"),
        ("alloc", "down", rh),           # :510 _grouped_linear (down)
        ("free", "gated"),
        ("alloc", "down masked", rh),    # :517 masked_fill
        ("free", "down"),
        ("alloc", "weighted", rh),       # :524 proj_out * sample_weights_g (unit weights)
        ("alloc", "unpermuted", rh),     # :529 weighted_out[inv_perm]
        ("free", "weighted"),
        ("alloc", "experts out", rh),    # :535 .sum(dim=1) over one slot (top-1)
        ("free", "sorted"),
        ("free", "down masked"),
        ("free", "unpermuted"),
        ("alloc", "recv out", sh),       # expert_parallel.py:241 all_to_all_single_autograd (combine)
        ("alloc", "token outputs", sh),  # :245 torch.empty_like(recv_out)
        ("alloc", "weighted tokens", sh),  # :248 token_outputs * top_k_weights
        ("alloc", "output", h * c),      # :248 .sum(dim=1)
        ("free", "weighted tokens"),
        ("free", "recv out"),
        ("free", "token outputs"),
        ("free", "recv"),
        ("free", "experts out"),
        ("free", "output"),              # (the block's residual add takes it; the walk's block lump holds that)
    ]


def ep_saved_widths(sent: float, received: float, h: int, f: int, c: int) -> list[int]:
    """Bytes per token of what the same forward under autograd keeps for the backward, in the order it makes them
    (the trace's: the sorted rows, the masked gate|up product, the activation and gated product on the received rows,
    the combine's token outputs on the sent; the rest it frees on the way)."""
    return [round(w * c) for w in (received * h, 2 * received * f, received * f, received * f, sent * h)]


def plan_peak(plan: list[tuple]) -> float:
    """The plan's largest live bytes per token (each name made once)."""
    sizes = {step[1]: step[2] for step in plan if step[0] == "alloc"}
    now = peak = 0.0
    for op, name, *_ in plan:
        now += sizes[name] if op == "alloc" else -sizes[name]
        peak = max(peak, now)
    return peak
