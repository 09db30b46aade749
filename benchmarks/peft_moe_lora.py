"""What peft 0.22's `target_modules="all-linear"` adapts on an MoE, and what those adapters cost a step (issue 28).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/peft_moe_lora.py            # ~1 min of CPU

Three parts, all on memory_accuracy.py's small configs (arch_config), LoRA rank R = 4, alpha 8, one adapter:

1. targets: every arch on the meta device (experts through transformers' grouped_mm kernel, as calibration/build.py
   builds them): the adapter tensors of one MoE block, and their elements against the formula
       router r(h + E) + gate_up 2r E (h + 2f) + down r E (f + h)  (+ 3r(h + fs) for a shared expert's linears)
   peft's transformers-5 conversion (utils/transformers_weight_conversion.py) turns all-linear into the v4 leaf names
   plus the router and the stacked experts as target_parameters, with rank 2r and alpha 2alpha on gate_up_proj (w1
   and w3 / gate and up fused). gpt-oss has no v4 -> v5 conversion (its experts were always stacked parameters), so
   all-linear there is the nn.Linear modules alone: the attention.
2. block: one MoE block (layers[1].mlp) on real CPU tensors, T tokens, one forward and backward (the output's
   gradient all ones): bytes saved for backward (saved_tensors_hooks: storages that are not parameters, each once,
   still alive when the forward returns),
   and the live bytes of the tensors the block's ops make (benchmarks/live_bytes.py: a dispatch mode counting storages
   as ops make them and as they are freed; parameters and the input not counted): the forward's peak, the forward +
   backward peak, and each baddbmm (peft's W + s * B @ A over the whole expert stack). Attention-only LoRA (the block
   has no adapter) against all-linear; the all-linear excess of saved bytes against
       p [3 E f h + S (h + f) + T h + E h]  (+ p rE(5f + 3h) when the adapters are kept in another dtype)
   with p the base weight's bytes per element and S = T k the routed rows; a shared expert (Qwen2-MoE, DeepSeek-V3)
   adds p T (fs + n r), n its adapted linears (4 with Qwen2-MoE's shared_expert_gate, else 3).
3. model: the whole qwen3-moe model, one forward + backward of one sequence of T tokens, its peak through
   calibration/memtrack.py's MemoryTracker, attention-only against all-linear.
"""

from __future__ import annotations

import sys
import warnings
import weakref

import torch

from benchmarks.live_bytes import LiveBytes

warnings.filterwarnings("ignore")
RANK, ALPHA = 4, 8
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ARCHS = ("mixtral", "qwen3-moe", "qwen2-moe", "deepseek-v3", "gpt-oss")


def dims(cfg: dict) -> dict:
    """(E experts, h hidden, f expert intermediate, k experts per token, fs shared-expert intermediate)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    shared = cfg.get("shared_expert_intermediate_size") or inter * cfg.get("n_shared_experts", 0)
    # adapted shared-expert linears: gate, up, down, and Qwen2-MoE's shared_expert_gate (h -> 1)
    shared_linears = (4 if "shared_expert_intermediate_size" in cfg else 3) if shared else 0
    return dict(E=experts, h=cfg["hidden_size"], f=inter, k=cfg["num_experts_per_tok"], fs=shared,
                shared_linears=shared_linears)


def build(arch: str, targets: str, device: str, dtype: torch.dtype):
    """The arch's model (calibration/build.py: grouped_mm experts) with peft LoRA on the attention or all-linear."""
    from peft import LoraConfig, get_peft_model

    from benchmarks.memory_accuracy import arch_config
    from calibration.build import build_model

    torch.manual_seed(0)
    model = build_model(None, arch_config(arch), device=device, dtype=dtype)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTENTION if targets == "attention" else targets,
                        init_lora_weights=False)   # B random, so the adapters' gradients are not all zero
    return get_peft_model(model, config)


def expected_moe_adapters(d: dict, r: int = RANK) -> dict[str, int]:
    """Adapter elements of one MoE block under all-linear, by target."""
    out = {"router": r * (d["h"] + d["E"]), "gate_up": 2 * r * d["E"] * (d["h"] + 2 * d["f"]),
           "down": r * d["E"] * (d["f"] + d["h"])}
    if d["fs"]:
        out["shared linears"] = 3 * r * (d["h"] + d["fs"])
    return out


def targets_part() -> None:
    from benchmarks.memory_accuracy import arch_config

    print(f"== 1. what all-linear adapts, one MoE block (layers.1), rank {RANK}")
    for arch in ARCHS:
        d = dims(arch_config(arch))
        peft = build(arch, "all-linear", "meta", torch.float32)
        cfg = peft.peft_config["default"]
        print(f"-- {arch} {d}: target_parameters {sorted(cfg.target_parameters or [])}, "
              f"rank_pattern {cfg.rank_pattern}")
        found = {}
        for name, param in peft.named_parameters():
            if "lora_" in name and ".layers.1." in name and "self_attn" not in name:
                path = name.split(".layers.1.")[1]
                print(f"   {path:55s} {tuple(param.shape)}")
                found[path] = param.numel()
        moe = sum(n for p, n in found.items() if ".experts." in p or ".gate.lora" in p)
        want = expected_moe_adapters(d)
        shared = sum(n for p, n in found.items() if "shared_expert" in p and "shared_expert_gate" not in p)
        formula = want["router"] + want["gate_up"] + want["down"]
        shared_note = f"; shared expert linears {shared:,}" if d["fs"] else ""
        print(f"   router + stacked experts: {moe:,} elements, formula {formula:,} {want}{shared_note}" if moe else
              "   no MoE adapter (the router and the experts are not nn.Linear and not converted)")


def measure_block(arch: str, targets: str, dtype: torch.dtype, tokens: int, hidden: int) -> dict:
    peft = build(arch, targets, "cpu", dtype)
    block = peft.base_model.model.model.layers[1].mlp
    x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
    params = {id(p.untyped_storage()) for p in peft.parameters()}
    saved: dict[int, weakref.ref] = {}   # by id: an id is reused only once its storage is gone

    def pack(t):
        storage = t.untyped_storage()
        if id(storage) not in params:
            saved[id(storage)] = weakref.ref(storage)
        return t

    mode = LiveBytes([*peft.parameters(), *peft.buffers(), x])
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
        y = y[0] if isinstance(y, tuple) else y
        forward_peak = mode.peak
        forward_ops = len(mode.made)
        # what the forward left for the backward (storages saved by graphs already dropped, e.g. the routing's, not)
        kept = sum(ref().nbytes() for ref in saved.values() if ref() is not None)
        y.backward(torch.ones_like(y))
    stacks = [(shape, n) for op, shape, n in mode.made[:forward_ops] if op == "baddbmm"]
    return dict(saved=kept, forward_peak=forward_peak, peak=mode.peak, baddbmm=stacks,
                adapter_dtype=next((p.dtype for n, p in peft.named_parameters() if "lora_" in n), None))


def expected_excess_saved(d: dict, tokens: int, p: int, adapters_cast: bool, r: int = RANK) -> int:
    """All-linear's excess of saved bytes in one MoE block (see the module docstring)."""
    E, h, f, k = d["E"], d["h"], d["f"], d["k"]
    rows = tokens * k
    cast = r * E * (5 * f + 3 * h) if adapters_cast else 0
    # a shared expert's plain lora.Linears: down's input (the others' is the block input, saved for the router) and
    # each lora_A's output
    shared = tokens * (d["fs"] + d["shared_linears"] * r) if d["fs"] else 0
    return p * (3 * E * f * h + rows * (h + f) + tokens * h + E * h + cast + shared)


def block_part(tokens: int) -> None:
    from benchmarks.memory_accuracy import arch_config

    print(f"\n== 2. one MoE block (layers.1.mlp), {tokens} tokens, forward + backward, real CPU tensors")
    for arch, dtypes in (("qwen3-moe", (torch.float32, torch.bfloat16)), ("mixtral", (torch.float32, torch.bfloat16)),
                         ("qwen2-moe", (torch.float32,)), ("deepseek-v3", (torch.float32,))):
        d = dims(arch_config(arch))
        for dtype in dtypes:
            base = measure_block(arch, "attention", dtype, tokens, d["h"])
            full = measure_block(arch, "all-linear", dtype, tokens, d["h"])
            p = torch.tensor([], dtype=dtype).element_size()
            cast = full["adapter_dtype"] != dtype
            want = expected_excess_saved(d, tokens, p, cast)
            excess = full["saved"] - base["saved"]
            print(f"-- {arch} {d} base {str(dtype)[6:]}, adapters {str(full['adapter_dtype'])[6:]}")
            print(f"   saved for backward: attention-only {base['saved']:,} B, all-linear {full['saved']:,} B, "
                  f"excess {excess:,} B, formula {want:,} B ({excess - want:+,})")
            print(f"   forward peak {base['forward_peak']:,} -> {full['forward_peak']:,} B; forward + backward peak "
                  f"{base['peak']:,} -> {full['peak']:,} B (+{full['peak'] - base['peak']:,})")
            print(f"   baddbmm outputs in the forward (E x out x in, bytes): {full['baddbmm']}")


def model_part(tokens: int) -> None:
    from benchmarks.memory_accuracy import arch_config
    from calibration.memtrack import MemoryTracker

    cfg = arch_config("qwen3-moe")
    print(f"\n== 3. whole qwen3-moe model ({cfg['num_hidden_layers']} MoE blocks), 1 x {tokens} tokens, fp32, "
          "forward + backward, MemoryTracker peak")
    peaks, params = {}, {}
    for targets in ("attention", "all-linear"):
        peft = build("qwen3-moe", targets, "cpu", torch.float32)
        ids = torch.randint(0, cfg["vocab_size"], (1, tokens))
        tracker = MemoryTracker(peft, vocab_size=cfg["vocab_size"])
        tracker.track_inputs(ids)
        with tracker:
            peft(input_ids=ids, labels=ids).loss.backward()
        snap = tracker.snapshot()
        peaks[targets], params[targets] = snap.peak_allocated_bytes, snap.breakdown["sharded_params"]
        print(f"   {targets:10s} peak {snap.peak_allocated_bytes:,} B ({snap.peak_phase}), activations "
              f"{snap.breakdown['activations']:,} B, params {snap.breakdown['sharded_params']:,} B")
    d = dims(cfg)
    per_block = expected_excess_saved(d, tokens, 4, False)
    extra_params = params["all-linear"] - params["attention"]
    print(f"   excess {peaks['all-linear'] - peaks['attention']:,} B; {cfg['num_hidden_layers']} x the block formula "
          f"{cfg['num_hidden_layers'] * per_block:,} B + the adapters' extra parameters {extra_params:,} B = "
          f"{cfg['num_hidden_layers'] * per_block + extra_params:,} B")


if __name__ == "__main__":
    n_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    targets_part()
    block_part(n_tokens)
    model_part(n_tokens)
