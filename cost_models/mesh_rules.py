"""Which mesh degrees a model, a cluster and a sequence allow: the one table of mesh rules.

The estimate and the API raise the first refusal as one line naming the field and what would be valid
(planner.api); the search only enumerates degrees that pass (planner/search/, `valid_degrees`). Rules:
- tp only for models the TP plan splits (TP_PLAN_FAMILIES; MoE models beside EP; not OLMo 2, whose q/k norms span
  the whole projection width);
- tp divides the attention heads, the KV heads and the MLP width: k_proj / v_proj are split column-wise, so tp
  above the KV heads would leave each rank part of a head (no dialect replicates KV heads: torchtitan refuses
  n_kv_heads % tp, transformers' tp_plan and the --emit fsdp2 plan split them plainly and the model's
  view(b, s, -1, head_dim) fails);
- without sequence parallel (transformers' tp_plan) the embedding is not tied to the head;
- cp: the sequence is a multiple of 2 x cp (load-balanced causal sharding gives each rank chunks i and
  2 cp - 1 - i); ring attention runs SDPA's fused kernels, not eager attention;
- ep: only for a model with routed experts, dividing them and dp_shard x cp x tp;
- tp x cp x pp divides the GPUs (the rest is data parallelism);
- pp: a block in every stage but the end ones, and the microbatches the schedule needs (cost_models/pipeline.py);
- QLoRA: a dense model whose block linears are named, no Float8 (cost_models/qlora.refusals).
The model's own limits come first, so `--tp 3` on 32 heads names the heads, not the GPU count.
"""

from __future__ import annotations

from . import moe_lora, qlora
from .feasibility import Refusal
from .pipeline import pipeline_refusals
from .specs import Attention, ClusterSpec, FsdpConfig, ModelSpec, TrainingSpec


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _list(values) -> str:
    values = list(values)
    return ", ".join(str(v) for v in values[:12]) + (", ..." if len(values) > 12 else "")


# Dense families whose blocks the TP plan splits (calibration/tensor_parallel.py, --emit fsdp2): separate q, k, v, o
# (self_attn.{q,k,v,o}_proj) and the MLP's linears, each as transformers' base_model_tp_plan names them: Llama's
# gate / up column-wise and down row-wise; Starcoder2's plain MLP c_fc column-wise (its bias split) and c_proj
# row-wise (its bias replicated). Fused q/k/v (GPT-2, GPT-NeoX, Phi-3, Falcon, BLOOM, MPT) and other layouts have no
# plan here; MoE models take TP beside EP only (torchtitan's etp = 1: --emit torchtitan). OLMo 2 is left out: its
# q / k norms span the whole projection width (qk_norm "full"), so transformers gathers q / k / v to every rank
# (colwise_gather_output, o rowwise_split_input); a plain column-wise split would norm each rank's slice alone, and
# neither the snippet nor the trace tier (calibration/tensor_parallel.py) writes the gathered plan.
LLAMA_MLP_PLAN = (("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise"))
TP_MLP_PLANS = {**dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"),
                                LLAMA_MLP_PLAN),
                "starcoder2": (("mlp.c_fc", "colwise"), ("mlp.c_proj", "rowwise"))}
TP_PLAN_FAMILIES = frozenset(TP_MLP_PLANS)
# q / k norms over head_dim (qk_norm "head"; transformers' replicated_with_grad_allreduce): each rank norms its own
# heads, so their weights' gradients are summed over tp. The dimension of the heads in the norm's input: Qwen3
# norms q_proj(x).view(b, s, heads, head_dim), Gemma 3 after .transpose(1, 2), (b, heads, s, head_dim).
TP_QK_NORM_HEADS_DIM = {"qwen3": 2, "gemma3_text": 1}
# Under sequence parallel every norm on the residual stream runs on s / tp tokens: Gemma 2 / 3's sandwich adds two
# to Llama's input_layernorm / post_attention_layernorm (one before and one after the MLP; left out, the first
# meets the Shard(1) DTensor with a plain weight and fails).
TP_SANDWICH_NORMS = dict.fromkeys(("gemma2", "gemma3_text"),
                                  ("pre_feedforward_layernorm", "post_feedforward_layernorm"))


def tp_plannable(model: ModelSpec, ep: int = 1) -> bool:
    """Whether tensor parallelism is planned for this model (with this expert-parallel degree)."""
    return ep > 1 if model.moe is not None else model.family in TP_PLAN_FAMILIES and model.qk_norm != "full"


def tp_degrees(model: ModelSpec, ep: int = 1) -> list[int]:
    """Tensor-parallel degrees the model's TP plan can split: heads, KV heads and MLP width."""
    if not tp_plannable(model, ep):
        return [1]
    return [t for t in divisors(model.n_heads) if model.n_kv_heads % t == 0 and _mlp_width(model) % t == 0]


def _mlp_width(model: ModelSpec) -> int:
    return model.moe.expert_ffn_size if model.moe is not None and not model.ffn_hidden_size else model.ffn_hidden_size


def cp_degrees(seq_len: int, limit: int) -> list[int]:
    """Context-parallel degrees for a sequence: 2 x cp divides it (load balancing), up to `limit`."""
    return [c for c in range(1, limit + 1) if seq_len % (2 * c) == 0 or c == 1]


def ep_degrees(model: ModelSpec, ranks: int) -> list[int]:
    """Expert-parallel degrees: divisors of the routed experts that divide dp_shard x cp x tp (`ranks`)."""
    if model.moe is None:
        return [1]
    return [e for e in divisors(model.moe.n_experts) if ranks % e == 0]


def checkpointing_priced(pp: int, schedule) -> bool:
    """Whether activation checkpointing is priced on this pipeline: not under a split backward (zero-bubble,
    DualPipeV), whose weight pass recomputes each checkpointed block once per parameter group (docs/accuracy.md,
    grid #29); mesh_refusals refuses it and the search leaves it out."""
    return pp == 1 or not schedule.split_backward


def mesh_refusals(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, config: FsdpConfig) -> list[Refusal]:
    """Every mesh rule `config` breaks here, in the table's order (empty: the mesh is valid)."""
    out: list[Refusal] = []
    n = cluster.n_gpus
    tp, cp, ep, pp = config.tp, config.cp, config.ep, config.pp
    if pp != 1:
        out.extend(pipeline_refusals(model, config))
    if tp > 1 and not tp_plannable(model, ep):
        why = ("tensor parallelism of routed experts is not planned: split them with --ep (TP then splits the "
               "attention, torchtitan's layout)" if model.moe is not None else
               f"{model.name}'s q/k norms span the whole projection width ({model.family}): transformers gathers "
               "q/k/v to every rank for them (colwise_gather_output), which this TP plan does not write"
               if model.qk_norm == "full" else
               f"{model.name}'s blocks ({model.family}) have no TP plan here (it splits separate q/k/v/o and "
               f"MLP projections, named as transformers' tp_plan names them: {', '.join(sorted(TP_PLAN_FAMILIES))})")
        out.append(Refusal("tp", "tp-not-planned-for-model", f"tp={tp}: {why}", "use tp 1", priced=False))
    elif tp > 1:
        valid = tp_degrees(model, ep)
        choices = f"choose one of: {_list(v for v in valid if n % v == 0)}"
        if tp not in valid and model.n_heads % tp == 0 and _mlp_width(model) % tp == 0:  # the KV heads alone
            out.append(Refusal("tp", "tp-does-not-divide-kv-heads",
                               f"tp={tp} does not divide {model.name}'s {model.n_kv_heads} KV heads: k_proj / v_proj "
                               "split column-wise would leave a rank part of a head (torchtitan and transformers "
                               "need n_kv_heads % tp == 0; no emitted plan replicates KV heads)", choices,
                               priced=False))
        elif tp not in valid:
            out.append(Refusal("tp", "tp-does-not-divide-heads",
                               f"tp={tp} does not split {model.name}'s {model.n_heads} attention heads, "
                               f"{model.n_kv_heads} KV heads and MLP width {model.ffn_hidden_size} evenly",
                               choices, priced=False))
    if tp > 1 and not config.sequence_parallel and model.tied_embeddings:
        out.append(Refusal("sequence_parallel", "tp-plan-with-tied-embeddings",
                           f"{model.name} ties its embedding to the head: transformers' tp_plan (no sequence parallel) "
                           "splits the head column-wise but keeps the embedding whole, which cannot share one weight",
                           "use sequence parallel (torchtitan's plan splits both over the vocabulary), or tp 1",
                           priced=False))
    if cp > 1:
        valid = cp_degrees(training.seq_len, n)
        if cp not in valid:
            out.append(Refusal("cp", "cp-does-not-divide-sequence",
                               f"cp={cp}: load-balanced ring attention splits each sequence into 2 x cp = {2 * cp} "
                               f"chunks, and seq_len={training.seq_len} is not a multiple of {2 * cp}",
                               f"choose one of: {_list(v for v in valid if n % v == 0)}", priced=False))
        if config.attention is not Attention.SDPA:  # FlexAttention's context parallel is not priced
            out.append(Refusal("attention", "cp-needs-sdpa", "context parallelism's ring attention runs SDPA's fused "
                               f"kernels, not {config.attention.value} attention", "use --attention sdpa, or cp 1",
                               priced=False))
    if ep > 1:
        if model.moe is None:
            out.append(Refusal("ep", "ep-on-dense-model", f"ep={ep}: {model.name} has no routed experts (a dense "
                               "model)", "use ep 1", priced=False))
        else:
            ranks = config.dp_shard_size(cluster) * cp * tp
            experts = model.moe.n_experts
            if experts % ep or ranks % ep:
                why = (f"does not divide the {experts} routed experts" if experts % ep else
                       f"does not divide dp_shard x cp x tp = {ranks} (EP borrows ranks from data and tensor "
                       "parallelism)")
                out.append(Refusal("ep", "ep-does-not-divide", f"ep={ep} {why}",
                                   f"choose one of: {_list(ep_degrees(model, ranks))}", priced=False))
    product = tp * cp * pp
    if n % product:
        valid = [k for k in divisors(n)]
        given = [name for name, value in (("tp", tp), ("cp", cp), ("pp", pp)) if value > 1]
        field = given[0] if len(given) == 1 else "mesh"  # one degree at fault, or their product
        out.append(Refusal(field, "mesh-does-not-divide-gpus",
                           f"tp x cp x pp = {tp} x {cp} x {pp} = {product} does not divide gpus={n}",
                           f"choose degrees whose product divides {n} (divisors: {_list(valid)})", priced=False))
    if (tp > 1 or cp > 1 or ep > 1 or pp > 1) and training.finetune.adapters:
        out.append(Refusal("finetune", "mesh-with-lora", "LoRA with tensor, context, expert or pipeline parallelism "
                           "is not planned (PEFT adapters on DTensor shards and stages)",
                           "use tp = cp = ep = pp = 1 with LoRA",
                           priced=False))
    out.extend(qlora.refusals(model, training, config))
    out.extend(moe_lora.refusals(model, training, config))
    if pp > 1 and config.offload:  # no pipeline trace or run prices it (calibration/trace_pipeline.py refuses offload)
        out.append(Refusal("offload", "pipeline-with-offload", "CPU offload with pipeline parallelism is not priced "
                           "(no pipeline trace or run measures FSDP2's CPUOffloadPolicy per stage under a schedule)",
                           "use pp 1 with offload, or no offload with pp", priced=False))
    if config.checkpoints and not checkpointing_priced(pp, config.pp_schedule):
        # the pipeline trace (docs/accuracy.md, grid #29): W runs one autograd call per parameter group and each keeps
        # a recompute of its checkpointed block; what each call frees is not derived, so the estimate is up to 47% low
        out.append(Refusal("activation_checkpointing", "split-backward-with-checkpointing",
                           f"{config.pp_schedule.value} with activation checkpointing is not priced (its weight pass "
                           "recomputes each checkpointed block once per parameter group: up to 1.9x the memory in "
                           "the pipeline trace)", "use activation checkpointing none with it, or 1f1b / "
                           "interleaved-1f1b; `fsdp-plan trace` measures it exactly", priced=False))
    return out
