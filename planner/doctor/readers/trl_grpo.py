"""Read a TRL GRPOConfig (YAML / JSON, TRL 1.16's field names, trl/trainer/grpo_config.py) with vLLM colocated,
and the accelerate config after it where --emit trl wrote one (a second YAML document): the batch back in verl's
terms (planner/emit/trl.py writes the other direction), the actor's FSDP version and offload from accelerate's
keys, the keys that decide TRL's passes (beta, num_iterations, vllm_importance_sampling_correction,
vllm_enable_sleep_mode: TRL's defaults where left out), TRL's ModelConfig LoRA keys in the same YAML (use_peft,
lora_r, lora_target_modules), the `# fsdp-plan:` line for what none has a key for;
vllm_mode server: the server's host and its commented `trl vllm-serve` line (planner/emit/trl_server.py)."""

from __future__ import annotations

import json
import math
from urllib.parse import urlparse

from planner.emit.rl_flags import read_planner_flags, typed
from planner.emit.trl import DTYPES
from planner.emit.trl_server import DEFAULTS, read_serve_line
from planner.errors import PlannerError

from .peft_targets import lora_targets
from .rl_setup import RlSetup

# request field -> GRPOConfig's key, to name it in an error
KEYS = {"rollout_n": "num_generations", "ppo_micro_batch_size_per_gpu": "per_device_train_batch_size",
        "gpu_memory_utilization": "vllm_gpu_memory_utilization", "rollout_tp": "vllm_tensor_parallel_size",
        "response_len": "max_completion_length", "prompt_len": "vllm_max_model_length", "lora_rank": "lora_r",
        "lora_targets": "lora_target_modules", "finetune": "use_peft"}
# GRPOConfig's keys that decide TRL's passes (cost_models/rl_schedule.py; the request's names are TRL's), with TRL
# 1.16's defaults
PASSES = {"beta": 0.0, "num_iterations": 1, "vllm_importance_sampling_correction": True,
          "vllm_enable_sleep_mode": False}
KEYS.update({name: name for name in PASSES})
# server mode: the engine's knobs are its launch line's
SERVER_KEYS = {"rollout_tp": "trl vllm-serve --tensor-parallel-size",
               "gpu_memory_utilization": "trl vllm-serve --gpu-memory-utilization",
               "vllm_server_data_parallel_size": "trl vllm-serve --data-parallel-size"}
_MARKERS = ("num_generations", "vllm_mode", "max_completion_length", "steps_per_generation")


def documents(path, text: str) -> list:
    """The file's mappings (YAML: every document; JSON: one); unreadable: [] (read_setup says why)."""
    try:
        if path.suffix == ".json":
            docs = [json.loads(text)]
        else:
            import yaml

            docs = list(yaml.safe_load_all(text))
    except Exception:  # yaml.YAMLError / JSONDecodeError: not ours to report
        return []
    return docs if docs and all(isinstance(d, dict) for d in docs) else []


def is_trl_grpo(data: dict) -> bool:
    return any(k in data for k in _MARKERS)


def _get(d: dict, key: str, field: str, default=None):
    return typed(field, d[key], key) if d.get(key) is not None else default


def from_trl_grpo(docs: list, source: str, text: str = "", gpus: int | None = None) -> RlSetup:
    """`gpus`: check's --gpus, over accelerate's num_processes and the fsdp-plan line (TRL counts its batch per
    process, so the prompts per step follow the GPU count)."""
    g = docs[0]
    if not g.get("use_vllm", False):
        raise PlannerError("use_vllm", "false: check prices generation in a vLLM engine (colocated or a server); "
                                       "valid: true")
    mode = str(g.get("vllm_mode") or "colocate")   # TRL 1.16's default
    if mode not in ("colocate", "server"):
        raise PlannerError("vllm_mode", f"{mode!r}; valid: colocate, server (grpo_config.py)")
    flags = read_planner_flags(text)
    model = flags.pop("model", None)
    notes = []
    read, per_node = _cluster(docs[1] if len(docs) > 1 else {}, flags)
    gpus, per_node = (gpus, None) if gpus is not None else (read, per_node)
    if gpus is None:
        raise PlannerError("gpus", "missing: a GRPOConfig does not say how many processes run it; pass --gpus (or "
                                   "give accelerate's config as a second YAML document)")
    micro = _get(g, "per_device_train_batch_size", "ppo_micro_batch_size_per_gpu", 8)   # TrainingArguments' default
    accum = _get(g, "gradient_accumulation_steps", "ppo_micro_batch_size_per_gpu", 1)
    n = _get(g, "num_generations", "rollout_n", 8)
    if accum * micro * gpus % n:   # TRL steps over part of a group; the plan counts its batches in prompts
        raise PlannerError("gradient_accumulation_steps", f"{accum}: an optimizer step's {accum * micro * gpus} "
                           f"completions (x per_device_train_batch_size {micro} x {gpus} processes) are not whole "
                           f"groups of num_generations {n}, which the plan cannot price; valid: a multiple of "
                           f"{n // math.gcd(n, micro * gpus)}")
    if g.get("generation_batch_size") is not None:
        per_generation = typed("train_batch", g["generation_batch_size"], "generation_batch_size") // (micro * gpus)
    else:
        per_generation = _get(g, "steps_per_generation", "train_batch", accum)
    response = _get(g, "max_completion_length", "response_len", 512)   # GRPOConfig's defaults (grpo_config.py)
    knobs = {"rollout_n": n, "ppo_micro_batch_size_per_gpu": micro, "response_len": response,
             "train_batch": per_generation * micro * gpus // n, "ppo_mini_batch_size": accum * micro * gpus // n,
             "gpu_memory_utilization": _get(g, "vllm_gpu_memory_utilization", "gpu_memory_utilization", 0.3),
             "rollout_tp": _get(g, "vllm_tensor_parallel_size", "rollout_tp", 1),
             # transformers 5's new name first; GRPOConfig checkpoints by default
             "gradient_checkpointing": _get(g, "activation_checkpointing", "gradient_checkpointing",
                                            _get(g, "gradient_checkpointing", "gradient_checkpointing", True)),
             "gpus": gpus, "gpus_per_node": per_node, "algorithm": "grpo", "engine": "vllm"}
    if g.get("vllm_max_model_length") is not None:
        knobs["prompt_len"] = typed("prompt_len", g["vllm_max_model_length"], "vllm_max_model_length") - response
    elif g.get("max_prompt_length") is not None:   # TRL before 1.0
        knobs["prompt_len"] = _get(g, "max_prompt_length", "prompt_len")
    # TRL 1.16 loads the model in fp32 when model_init_kwargs names no dtype (utils.py create_model_from_path)
    dtype = str((g.get("model_init_kwargs") or {}).get("dtype", "float32")).removeprefix("torch.")
    by_name = {v: k for k, v in DTYPES.items()} | {"fp32": "fp32", "bf16": "bf16"}
    if dtype not in by_name:
        notes.append(f"model_init_kwargs.dtype {dtype}: the checkpoint's dtype, priced as bf16")
    knobs["actor_dtype"] = by_name.get(dtype, "bf16")
    knobs.update({name: _get(g, name, name, default) for name, default in PASSES.items()})
    knobs.update(_peft(g, notes))
    if mode == "server":
        knobs.update(_server(g, text, notes))
    knobs.update(_accelerate(docs[1]) if len(docs) > 1 else {})
    return RlSetup(knobs={"framework": "trl", **knobs, **flags}, source=source, dialect="trl-grpo", model=model,
                   model_path=g.get("model_name_or_path"), model_key="model_name_or_path", notes=tuple(notes),
                   keys={**KEYS, **(SERVER_KEYS if mode == "server" else {})})


def _peft(g: dict, notes: list) -> dict:
    """TRL's ModelConfig keys in the same YAML (TRL 1.16's trl/scripts/grpo.py parses ScriptArguments, GRPOConfig and
    ModelConfig from one file; get_peft_config: LoraConfig(r=lora_r, target_modules=lora_target_modules) where
    use_peft): LoRA at lora_r (ModelConfig's default 16) on its targets as peft_targets reads them (None: peft's
    per-family default, priced as the attention projections); use_peft false (the default): full fine-tuning."""
    if not typed("param_offload", g.get("use_peft", False), "use_peft"):   # a bool field's type, named use_peft
        return {}
    targets, said = lora_targets(g.get("lora_target_modules"))
    notes.extend(said)
    return {"finetune": "lora", "lora_rank": _get(g, "lora_r", "lora_rank", 16), "lora_targets": targets}


def _server(g: dict, text: str, notes: list) -> dict:
    """vllm_mode server: where the server runs (vllm_server_base_url's host, else vllm_server_host: TRL's default
    0.0.0.0 is this node) and its knobs from the commented launch line (planner/emit/trl_server.py), else trl
    vllm-serve's defaults (TP 1, DP 1, utilization 0.9). TRL ignores the colocated engine's keys there."""
    url = g.get("vllm_server_base_url")
    host = urlparse(str(url)).hostname if url else g.get("vllm_server_host")
    line = read_serve_line(text)
    if line is None:
        notes.append("vllm_mode server: no `trl vllm-serve` line in the file; priced at its defaults (TP 1, DP 1, "
                     "gpu_memory_utilization 0.9): add the server's line as a comment")
        line = dict(DEFAULTS)
    return {"vllm_mode": "server", **({"vllm_server_host": str(host)} if host is not None else {}), **line}


def _cluster(accelerate: dict, flags: dict) -> tuple[int, int | None]:
    """GPUs from accelerate's num_processes / num_machines, else the fsdp-plan line's --gpus, else None."""
    if "num_processes" in accelerate:
        gpus = typed("gpus", accelerate["num_processes"], "num_processes")
        machines = typed("gpus", accelerate.get("num_machines", 1), "num_machines")
        return gpus, gpus // machines
    return flags.pop("gpus", None), flags.pop("gpus_per_node", None)   # None: check asks for --gpus


def _accelerate(a: dict) -> dict:
    fsdp = a.get("fsdp_config") or {}
    offload = typed("param_offload", fsdp.get("fsdp_offload_params", False), "fsdp_config.fsdp_offload_params")
    version = typed("fsdp_size", fsdp.get("fsdp_version", 1), "fsdp_config.fsdp_version")
    return {"strategy": "fsdp2" if version == 2 else "fsdp", "param_offload": offload, "optimizer_offload": offload}
