"""Pieces every emitter shares (planner/emit/ dispatches to the dialect modules, which import only this,
never each other): the plan's summary comment, FSDP option spellings, the caveat notes, torchrun's
arguments and the launch's environment (launch_env). Pure strings: no torch import.
"""

from __future__ import annotations

import json
import re
import shlex

from cost_models import fsdp_options
from cost_models.mesh import mesh_of
from cost_models.specs import ClusterSpec, FsdpConfig, ModelSpec, Precision, TrainingSpec

from planner.emit import qlora
from planner.emit.code import techniques as tech

RDZV_PORT = 29500
ALLOC_CONF_VAR = "PYTORCH_CUDA_ALLOC_CONF"
OMP_VAR = "OMP_NUM_THREADS"
# Why training turns a Hugging Face model's KV cache off (calibration.apply.disable_kv_cache does the same).
_KV_CACHE_WHY = ("no KV cache in training: left on (HF's default), each checkpointed recompute appends to it "
                 "until backward ends")


# FSDP2's reshard_after_forward in words, for the comment beside it
RESHARD_NOTE = {True: "free gathered params after forward (ZeRO-3)", False: "keep them for backward (ZeRO-2)"}


def hsdp_note(config: FsdpConfig) -> str:
    """The words beside HSDP's replicate degree: replicas across nodes, or of the plan's shard group."""
    if not config.shard_group_gpus:
        return "HSDP: replicas across nodes"
    return f"HSDP: replicas of shard groups of {config.shard_group_gpus} GPUs"


def reshard_entry(config: FsdpConfig, key: str) -> tuple[str, bool, str]:
    """FSDP2's reshard_after_forward for the plan as a (key, value, comment) config entry."""
    reshard = fsdp_options.fully_shard_options(config)["reshard_after_forward"]
    return key, reshard, RESHARD_NOTE[reshard]


def _summary(config: FsdpConfig, model_spec: ModelSpec, cluster: ClusterSpec) -> list[str]:
    """Comment lines naming the plan: model, cluster, every knob, and the batch it assumes."""
    offload = "params+grads on CPU, optimizer step on CPU" if config.offload else "none"
    return [
        f"FSDP plan for {model_spec.name} on {cluster.n_gpus} x {cluster.gpu.name} "
        f"({cluster.n_nodes} node(s) x {cluster.gpus_per_node})",
        f"sharding {config.sharding.value}, precision {config.precision.value}"
        f"{f' (gradients reduced in {config.reduce_dtype})' if config.reduce_dtype else ''}, offload {offload}, "
        f"activation checkpointing {config.activation_checkpointing}, attention {config.attention.value}",
        f"micro-batch {config.micro_batch} per GPU, gradient accumulation {config.grad_accum}" if config.pp == 1 else
        f"pipeline microbatch {config.micro_batch}, {config.pp_microbatches} microbatches per schedule step",
        *tech.summary_line(config),
        *mesh_summary(config, cluster),
    ]


def mesh_summary(config: FsdpConfig, cluster: ClusterSpec) -> list[str]:
    """The plan's device mesh in one line (none for data parallelism alone, so those plans emit as before)."""
    if config.tp == config.cp == config.ep == config.pp == 1:
        return []
    mesh = mesh_of(config, cluster)
    dims = " x ".join(f"{name} {size}" for name, size in mesh.used_dims())
    experts = f"; experts on efsdp {mesh.efsdp} x ep {mesh.ep}" if mesh.ep > 1 else ""
    tp = ("" if config.tp == 1 else ", TP with sequence parallel and loss parallel (torchtitan's)"
          if config.sequence_parallel else ", TP as transformers' tp_plan (no sequence parallel)")
    return [f"mesh {mesh.describe()}: {dims}{experts}{tp}"]


def _comment(lines: list[str]) -> str:
    return "\n".join(f"# {line}" for line in lines)


def _mixed_dtypes(config: FsdpConfig) -> tuple[str, str] | None:
    """(param_dtype, reduce_dtype) as torch expressions ("None" for a parameter dtype FSDP leaves alone), or
    None when FSDP must not cast (fp32, bf16-pure, without a reduce_dtype of their own)."""
    names = fsdp_options.mixed_precision_dtypes(config.precision, config.reduce_dtype)
    if names is None:
        return None
    param = names["param_dtype"]
    return ("None" if param is None else f"torch.{param}"), f"torch.{names['reduce_dtype']}"


def _fsdp1_strategy(config: FsdpConfig, cluster: ClusterSpec) -> tuple[str, str]:
    return fsdp_options.fsdp1_strategy(config, cluster.gpus_per_node)


def _notes(config: FsdpConfig, training: TrainingSpec | None = None, model_spec: ModelSpec | None = None) -> list[str]:
    """Caveats that change the training loop rather than the wrapping."""
    notes = []
    if config.precision is Precision.FP16:
        notes.append("fp16 gradients underflow without loss scaling: use torch.distributed.fsdp.sharded_grad_scaler."
                     "ShardedGradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update()). "
                     "bf16 needs no scaler.")
    if config.offload:
        notes.append("offload: create the optimizer after wrapping; its step runs on the CPU (often the "
                     "bottleneck), and CPU RAM per node must hold the params, grads and optimizer state.")
    if training is not None and training.finetune.value == "lora":
        kwargs = qlora.priced_lora_kwargs_text(training, model_spec)
        targets = f", LoraConfig({kwargs}): as priced" if kwargs else ""
        notes.append(f"LoRA: apply the adapters (get_peft_model{targets}) before wrapping; the plan counts the frozen "
                     "base in the compute dtype (from_pretrained(dtype=torch.bfloat16)) and peft's fp32 adapters. "
                     "FSDP1 needs the adapters in units of their own (the fsdp1 snippet's CustomPolicy; HF Trainer "
                     "does it for PEFT models; plain accelerate: auto_wrap_policy=peft.utils.other.fsdp_auto_wrap_policy(model)).")
    if config.loss_compiled:
        notes.append(tech.COMPILED_LOSS_NOTE)
    if config.expert_units:
        notes.append("expert units: the plan wraps each block's routed experts (the module holding the stacked expert "
                     "tensors) as an FSDP2 unit of its own before the block, as --emit fsdp2 writes; for FSDP1 or "
                     "accelerate add that module's class to the wrap policy's classes.")
    return notes


def torchrun_args(cluster: ClusterSpec, script: str = "train.py", *, nnodes: str | None = None,
                  endpoint: str = f"$MASTER_ADDR:{RDZV_PORT}", rdzv_id: str = "fsdp-plan") -> list[str]:
    """torchrun's arguments, one list for every launcher (torchrun, slurm, pytorchjob, hf-trainer): standalone on
    one node, else one c10d rendezvous at `endpoint` for `nnodes` nodes (default: the cluster's count)."""
    if nnodes is None and cluster.n_nodes == 1:
        return ["--standalone", "--nproc_per_node", str(cluster.gpus_per_node), script]
    return ["--nnodes", nnodes or str(cluster.n_nodes), "--nproc_per_node", str(cluster.gpus_per_node),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", rdzv_id, script]


def torchrun_command(cluster: ClusterSpec, script: str = "train.py", env: dict | None = None) -> str:
    """The torchrun line; env: the variables set for it (launch_env), PyTorch's defaults left out."""
    return " ".join([*env_words(env or {}), "torchrun", *torchrun_args(cluster, script)])


def env_words(env: dict) -> list[str]:
    """Shell assignments of `env`, for a command's prefix or an `export`."""
    return [f"{name}={shlex.quote(value)}" for name, value in env.items()]


# What a launcher gives its ranks when OMP_NUM_THREADS is unset; None: a count that depends on the machine.
LAUNCHER_THREADS = {
    "accelerate": 1,   # accelerate launch: --num_cpu_threads_per_process, default 1 (accelerate/commands/launch.py)
    "ray": 1,          # Ray, an actor without num_cpus (verl's workers): ray/_private/utils.py
    #                    set_omp_num_threads_if_unset
    "lightning": None,  # cpus / processes (lightning/fabric/utilities/distributed.py _set_num_threads_if_needed)
}


def launcher_threads(launcher: str, cluster: ClusterSpec) -> int | None:
    """LAUNCHER_THREADS; torchrun sets 1 only with more than one process a node (torch/distributed/run.py
    config_from_args): with one, torch runs a thread per core."""
    if launcher == "torchrun":
        return 1 if cluster.gpus_per_node > 1 else None
    return LAUNCHER_THREADS[launcher]


def cpu_step_threads(cluster: ClusterSpec, cpu_step: bool, launcher: str = "torchrun") -> dict:
    """{OMP_NUM_THREADS: the threads each rank's optimizer step on the host is priced with} (HostCpu.threads_per_rank,
    --omp-num-threads: cost_models/host_optimizer.py) where a step runs on the CPU and the launcher would give the
    ranks another count; else {}. The one rule every launch line and environment follows."""
    threads = cluster.host_cpu.threads_per_rank
    return {OMP_VAR: str(threads)} if cpu_step and threads != launcher_threads(launcher, cluster) else {}


def launch_env(config: FsdpConfig, cluster: ClusterSpec, launcher: str = "torchrun") -> dict:
    """The variables a plan's launch sets: PYTORCH_CUDA_ALLOC_CONF where not PyTorch's default (c10's allocator reads
    it once, at its first CUDA allocation), and OMP_NUM_THREADS for a CPU optimizer step (CPU offload:
    cpu_step_threads). The launcher's workers inherit both."""
    return {**({ALLOC_CONF_VAR: config.alloc_conf} if config.alloc_conf else {}),
            **cpu_step_threads(cluster, config.offload, launcher)}


def multi_node_note(cluster: ClusterSpec) -> list[str]:
    if cluster.n_nodes == 1:
        return []
    return [f"run the same command on each of the {cluster.n_nodes} nodes; "
            "MASTER_ADDR = the address of any one of them"]



def _fsdp1_only_notes(config: FsdpConfig, fsdp1_form: str) -> list[str]:
    """FSDP1 knobs of the plan that an FSDP2 dialect has no key for (FSDP2 prefetches and bounds its
    all-gathers by itself)."""
    knobs = [name for name, off_default in (("backward_prefetch=None", not config.backward_prefetch),
                                            ("forward_prefetch=True", config.forward_prefetch),
                                            ("limit_all_gathers=False", config.limit_all_gathers is False))
             if off_default]
    if not knobs:
        return []
    return [f"the plan's FSDP1 settings {', '.join(knobs)} have no FSDP2 form (FSDP2 always prefetches the next "
            f"unit in backward and bounds its own all-gathers): {fsdp1_form} sets them"]


def _expert_notes(config: FsdpConfig, dialect: str) -> list[str]:
    notes = []
    if config.expert_units:
        notes.append(f"the plan wraps each block's routed experts as an FSDP unit of its own, which {dialect} cannot "
                     "say: add that module's class to the units, or use --emit fsdp2")
    if config.expert_shard_dim:
        notes.append(f"the plan shards stacked MoE experts on dim 1 (shard_placement_fn), which {dialect} cannot set: "
                     "FSDP2 pads them on dim 0 (--emit fsdp2 has it)")
    return notes


# ---------------------------------------------------------------- Hugging Face Trainer (transformers 5)


# Hub ids of the presets whose catalog source names none in its first words (planner/catalog/models.json)
HUB_IDS = {"qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B", "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
           "gpt-oss-20b": "openai/gpt-oss-20b", "gpt-oss-120b": "openai/gpt-oss-120b",
           "deepseek-v3": "deepseek-ai/DeepSeek-V3", "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
           "llama3-8b": "meta-llama/Meta-Llama-3-8B", "llama3.1-8b": "meta-llama/Llama-3.1-8B"}


def hub_id(model: ModelSpec) -> str:
    """The model's Hugging Face id (the YAML dialects' base model): the table above, else the first word of its
    catalog source when it reads like one ("Org/Name config.json: ..."), else its name (a path or id the user
    gave)."""
    name = model.name.split(" ")[0]
    if name in HUB_IDS:
        return HUB_IDS[name]
    try:
        from planner.models import preset_source

        first = preset_source(name).split(" ")[0]
    except Exception:  # not a preset: a config.json path or a Hub id, used as given
        return name
    return first if re.fullmatch(r"[\w.-]+/[\w.-]+", first) else name


# words YAML 1.1 (PyYAML) reads as booleans or null when bare
YAML_11_WORDS = ("null", "true", "false", "yes", "no", "on", "off", "y", "n")


def yaml_scalar(value) -> str:
    """A YAML value: null / true / false, numbers, strings quoted where YAML would read them otherwise; a tuple as a
    flow sequence, a dict as a flow mapping."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):  # YAML 1.1 (PyYAML) reads 1e-05 as text: the mantissa needs its point
        mantissa, e, exponent = repr(value).partition("e")
        return f"{mantissa}{'' if '.' in mantissa or not e else '.0'}{e}{exponent}"
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(yaml_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_scalar(v)}" for k, v in value.items()) + "}"
    text = str(value)
    plain = re.fullmatch(r"[A-Za-z_][\w./-]*", text) and text.lower() not in YAML_11_WORDS
    return text if plain else json.dumps(text)


def yaml_lines(entries, indent: int = 0) -> list[str]:
    """(key, value or nested entries as a list, comment) -> YAML lines."""
    out = []
    for key, value, *comment in entries:
        note = f"  # {comment[0]}" if comment and comment[0] else ""
        if isinstance(value, list):
            out.append(f"{' ' * indent}{key}:{note}")
            out.extend(yaml_lines(value, indent + 2))
        else:
            out.append(f"{' ' * indent}{key}: {yaml_scalar(value)}{note}")
    return out
