"""Read a verl job as users write it: a launch script (`python3 -m verl.trainer.main_ppo key=value ...`, line
continuations, `$VAR` / `${VAR:-default}` resolved where the script sets them), a bare list of Hydra overrides, or
a verl YAML (nested keys, as ppo_trainer.yaml). The keys are verl 0.9's (planner/emit/verl.py owns the mapping,
both directions); the `# fsdp-plan:` line --emit verl writes adds what verl has no key for."""

from __future__ import annotations

import re
import shlex

from cost_models.rl_lora_targets import module_names
from planner.emit import verl as keys
from planner.emit.rl_flags import read_planner_flags, typed
from planner.errors import PlannerError

from .rl_setup import RlSetup
from .torchtitan import _flatten   # nested keys to dotted ones

A = keys.A
_COMMAND = "verl.trainer.main_ppo"
_STOP = {"|", "||", "&&", ";", "&"}
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")
_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=(.*)$")
_OVERRIDE = re.compile(r"^\+{0,2}(?:actor_rollout_ref|data|trainer|algorithm|critic|reward|reward_model)\.[\w.]+=", re.M)


def is_verl_script(text: str) -> bool:
    return _COMMAND in text or bool(_OVERRIDE.search(text))


def is_verl_yaml(data: dict) -> bool:
    return isinstance(data.get("actor_rollout_ref"), dict)


def _expand(value: str, env: dict) -> str:
    def sub(m):
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        return m.group(2) if m.group(2) is not None else m.group(0)   # unset: the default, else left as written
    return _VAR.sub(sub, value)


def script_overrides(text: str) -> dict[str, str]:
    """key -> value as the shell would pass it to main_ppo (the last one wins, as in Hydra)."""
    joined = re.sub(r"\\\n", " ", text)
    env, tokens = {}, None
    for line in joined.splitlines():
        if _COMMAND in line:
            tokens = shlex.split(line.split(_COMMAND, 1)[1], comments=True)
            break
        m = _ASSIGN.match(line)
        if m and not line.lstrip().startswith("#"):
            words = shlex.split(m.group(2), comments=True)
            env[m.group(1)] = _expand(words[0] if words else "", env)
    if tokens is None:  # a bare list of overrides
        tokens = shlex.split(joined, comments=True)
    out = {}
    for token in tokens:
        if token in _STOP or token.startswith((">", "1>", "2>")):
            break
        if "=" in token and not token.startswith(("-", "~")):
            key, value = token.split("=", 1)
            out[key.lstrip("+")] = _expand(value, env)
    return out


def from_verl_script(text: str, source: str) -> RlSetup:
    dialect = "verl-script" if _COMMAND in text else "verl-overrides"
    return from_overrides(script_overrides(text), source, dialect, text)


def from_verl_yaml(data: dict, source: str, text: str = "") -> RlSetup:
    return from_overrides(_flatten(data), source, "verl-yaml", text)


def _value(o: dict, key: str, field: str):
    value = o[key]
    if isinstance(value, str) and "$" in value:
        raise PlannerError(key, f"{value!r} refers to a variable the script does not set: set it in the script "
                                "or write the value")
    return typed(field, value, key)


def _first(o: dict, *names: str):
    return next((n for n in names if n in o and o[n] is not None and str(o[n]).lower() not in ("null", "none")),
                None)


def from_overrides(o: dict, source: str, dialect: str, text: str = "") -> RlSetup:
    """The request knobs of verl overrides (key -> value) over verl's defaults, with what the reader assumed."""
    o = {**keys.VERL_DEFAULTS, **o}
    if A + "rollout.name" not in o:   # '???' in verl's rollout.yaml: Hydra refuses to start without it
        raise PlannerError(A + "rollout.name", "missing: verl requires it; valid: vllm, sglang")
    knobs, notes = {}, []
    for key, field in {**keys.KEYS, **keys.CRITIC_KEYS, **keys.ENV_KEYS}.items():
        if key in o:
            knobs[field] = _value(o, key, field)
    for key in (A + "actor.fsdp_config.ulysses_sequence_parallel_size",):  # verl 0.9's own place for it
        if key in o and "ulysses_sequence_parallel_size" not in knobs:
            knobs["ulysses_sequence_parallel_size"] = _value(o, key, "ulysses_sequence_parallel_size")
    adv = str(o["algorithm.adv_estimator"]).strip("'\"")
    knobs["algorithm"] = "ppo" if adv == "gae" else "grpo"
    if adv == "gae":  # the critic's own Ulysses degree: verl's default 1 (dp_critic.yaml) unless the script says
        knobs.setdefault("critic_ulysses_sequence_parallel_size", 1)
        _critic(o, knobs)
    if adv not in ("gae", "grpo"):
        notes.append(f"algorithm.adv_estimator={adv}: priced as GRPO (no critic)")
    if A + "actor.ppo_mini_batch_size" in o:
        knobs["ppo_mini_batch_size"] = _value(o, A + "actor.ppo_mini_batch_size", "ppo_mini_batch_size")
    if A + "actor.fsdp_config.model_dtype" in o:
        knobs["actor_dtype"] = _dtype(o, A + "actor.fsdp_config.model_dtype")
    rank = _value(o, A + "model.lora_rank", "lora_rank") if A + "model.lora_rank" in o else 0
    knobs["finetune"] = "lora" if rank > 0 else "full"
    if rank > 0:
        knobs["lora_rank"] = rank
        if keys.LORA_MERGE in o:
            knobs["lora_merge"] = typed("lora_merge", o[keys.LORA_MERGE], keys.LORA_MERGE)
        if keys.TARGET_MODULES in o:
            knobs["lora_targets"] = _targets(o)
    _sglang_kwargs(o, knobs, notes)
    _batches(o, knobs)
    _entropy(o, knobs, notes)
    _reward(o, knobs, notes)
    gpus_per_node = _value(o, "trainer.n_gpus_per_node", "gpus_per_node") if "trainer.n_gpus_per_node" in o else 8
    nnodes = _value(o, "trainer.nnodes", "gpus") if "trainer.nnodes" in o else 1
    knobs.update(gpus=gpus_per_node * nnodes, gpus_per_node=gpus_per_node)
    flags = read_planner_flags(text)
    model = flags.pop("model", None)
    path = o.get(A + "model.path")
    if isinstance(path, str) and "$" in path:
        path = None if model else _value(o, A + "model.path", "model")   # unresolved: one line naming the key
    named = {f: k for k, f in {**keys.KEYS, **keys.CRITIC_KEYS, **keys.ENV_KEYS}.items()} | {
        "algorithm": "algorithm.adv_estimator", "actor_dtype": A + "actor.fsdp_config.model_dtype",
        "critic_strategy": "critic.strategy", "critic_dtype": "critic.fsdp.model_dtype",
        "ppo_mini_batch_size": A + "actor.ppo_mini_batch_size", "lora_rank": A + "model.lora_rank",
        "lora_merge": keys.LORA_MERGE, "lora_targets": keys.TARGET_MODULES, "max_loras_per_batch": keys.MAX_LORAS,
        "reward_model": keys.RM + "model_path", **{f: k for k, f in keys.POOL_KEYS.items()}}
    return RlSetup(knobs={**knobs, **flags}, source=source, dialect=dialect, model=model, model_path=path,
                   model_key=A + "model.path", notes=tuple(notes), keys=named)


def _dtype(o: dict, key: str) -> str:
    """A model_dtype as verl's PrecisionType reads it (fp32 / float32, bf16 / bfloat16), as the request names it."""
    dtype = str(o[key]).strip("'\"").lower()
    dtypes = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
    if dtype not in dtypes:
        raise PlannerError(key, f"unknown value {dtype!r}; choose one of: fp32, bf16")
    return dtypes[dtype]


def _targets(o: dict) -> str:
    """model.target_modules as the request takes it: all-linear, or a list (YAML; a script's Hydra [a,b]) as its
    names comma-separated, priced by the model (cost_models/rl_lora_targets.py). Any other string PEFT matches as a
    regex against every module's whole name (verl utils/model.py check_target_modules: re.fullmatch): refused."""
    value = o[keys.TARGET_MODULES]
    names = module_names(_value(o, keys.TARGET_MODULES, "lora_targets") if isinstance(value, str) else value)
    if isinstance(names, str) and names != "all-linear":
        raise PlannerError(keys.TARGET_MODULES, f"{names!r} is a regex to PEFT, not priced; choose one of: all-linear, "
                                                "or the attention projections as a list, e.g. "
                                                "[q_proj,k_proj,v_proj,o_proj]")
    return names if isinstance(names, str) else ",".join(names)


def _sglang_kwargs(o: dict, knobs: dict, notes: list) -> None:
    """rollout.engine_kwargs.sglang.max_loras_per_batch: SGLang's LoRA pool slots, passed to its ServerArgs
    (keys.MAX_LORAS); verl reads engine_kwargs.sglang only when it starts SGLang, so under another engine it is
    ignored, and said."""
    if keys.MAX_LORAS not in o:
        return
    if knobs.get("engine") == "sglang":
        knobs["max_loras_per_batch"] = _value(o, keys.MAX_LORAS, "max_loras_per_batch")
    else:
        notes.append(f"{keys.MAX_LORAS} is ignored: verl passes engine_kwargs.sglang to SGLang only, and "
                     f"rollout.name is {knobs.get('engine')}")


def _critic(o: dict, knobs: dict) -> None:
    """The critic's strategy and stored dtype as verl runs them, whatever the actor runs: critic.strategy and
    critic.fsdp.model_dtype, verl's defaults where the script leaves them out (keys.CRITIC_DEFAULTS). Its
    offload_policy under critic.strategy fsdp is priced ignored, and said (planner/rl/findings.py), as verl reads it
    in its FSDP2 branch only (FSDPEngine._build_fsdp_module)."""
    o = {**keys.CRITIC_DEFAULTS, **o}
    knobs["critic_strategy"] = _value(o, "critic.strategy", "critic_strategy")
    knobs["critic_dtype"] = _dtype(o, "critic.fsdp.model_dtype")


def _reward(o: dict, knobs: dict, notes: list) -> None:
    """A reward model: verl 0.9.1's reward.reward_model.* keys, or the legacy reward_model.* ones it migrates
    (enable, model.path, rollout.*, its pool's enable_resource_pool / n_gpus_per_node / nnodes); the later
    spelling wins, as migrate_legacy_reward_impl writes it. Its own pool with nnodes left out is verl's default 0
    (which verl refuses); with free_cache_engine left true its engine sleeps at start and is never woken: said."""
    def key(new: str, old: str):
        return _first(o, keys.RM + new, "reward_model." + old)
    enable = key("enable", "enable")
    if enable is None or not _value(o, enable, "use_dynamic_bsz"):   # a bool, read as the flags' bools are
        return
    path = key("model_path", "model.path")
    if path is None:
        raise PlannerError(keys.RM + "model_path", "missing: reward_model.enable needs the reward model's path "
                                                  "(a preset, config.json or cached Hub id)")
    knobs["reward_model"] = str(_value(o, path, "reward_model")).strip("'\"")
    for field, name in (("reward_model_tp", "tensor_model_parallel_size"),
                        ("reward_model_gpu_memory_utilization", "gpu_memory_utilization")):
        found = key("rollout." + name, "rollout." + name)
        if found is not None:
            knobs[field] = _value(o, found, field)
    pool = key("enable_resource_pool", "enable_resource_pool")
    if pool is None or not _value(o, pool, "reward_model_enable_resource_pool"):
        return
    for name, field in keys.POOL_KEYS.items():
        found = key(name.removeprefix(keys.RM), name.removeprefix(keys.RM))
        knobs[field] = _value(o, found, field) if found is not None else POOL_DEFAULTS.get(field, True)
    awake = key("rollout.free_cache_engine", "rollout.free_cache_engine")
    if awake is None or _value(o, awake, "reward_model_enable_resource_pool"):
        notes.append(f"{keys.POOL_AWAKE} is true (verl's default): on its own pool the reward engine sleeps at start "
                     "(RewardModelManager) and the agent loop's streaming scoring never wakes it; set "
                     f"{keys.POOL_AWAKE}=False (priced awake)")


# verl 0.9.1's reward.yaml where a script with a pool leaves them out (nnodes 0: verl raises, and so does the planner)
POOL_DEFAULTS = {"reward_model_n_gpus_per_node": 8, "reward_model_nnodes": 0}


def _batches(o: dict, knobs: dict) -> None:
    """Static micro-batches or dynamic token budgets; the log-prob ones from the rollout's keys (else the ref's).
    verl's global ppo_micro_batch_size (deprecated) is divided by the data-parallel ranks, as fsdp_workers does."""
    if A + "actor.ppo_micro_batch_size_per_gpu" in o:
        knobs["ppo_micro_batch_size_per_gpu"] = _value(o, A + "actor.ppo_micro_batch_size_per_gpu",
                                                       "ppo_micro_batch_size_per_gpu")
    elif _first(o, A + "actor.ppo_micro_batch_size"):
        gpus = int(o.get("trainer.n_gpus_per_node", 8)) * int(o.get("trainer.nnodes", 1))
        sp = knobs.get("ulysses_sequence_parallel_size", 1)
        knobs["ppo_micro_batch_size_per_gpu"] = max(1, int(o[A + "actor.ppo_micro_batch_size"]) // (gpus // sp))
    elif not knobs.get("use_dynamic_bsz"):   # verl workers/config/actor.py asserts one of them
        raise PlannerError(A + "actor.ppo_micro_batch_size_per_gpu", "missing: verl requires it (or the "
                                                                     "deprecated ppo_micro_batch_size) unless "
                                                                     "actor.use_dynamic_bsz=True")
    key = _first(o, A + "rollout.log_prob_micro_batch_size_per_gpu", A + "ref.log_prob_micro_batch_size_per_gpu")
    if key:
        knobs["log_prob_micro_batch_size_per_gpu"] = _value(o, key, "log_prob_micro_batch_size_per_gpu")
    if A + "actor.ppo_max_token_len_per_gpu" in o:
        knobs["ppo_max_token_len_per_gpu"] = _value(o, A + "actor.ppo_max_token_len_per_gpu",
                                                    "ppo_max_token_len_per_gpu")
    key = _first(o, A + "rollout.log_prob_max_token_len_per_gpu", A + "ref.log_prob_max_token_len_per_gpu")
    if key:
        knobs["log_prob_max_token_len_per_gpu"] = _value(o, key, "log_prob_max_token_len_per_gpu")


def _entropy(o: dict, knobs: dict, notes: list) -> None:
    """verl 0.9 computes the update's entropy when actor.calculate_entropy or entropy_coeff != 0
    (ray_trainer._update_actor); the log-prob pass always does. Neither key written: priced with it, as verl's
    2025 default (entropy_coeff 0.001) ran it."""
    calc, coeff = A + "actor.calculate_entropy", A + "actor.entropy_coeff"
    if calc not in o and coeff not in o:
        notes.append("the update is priced with the entropy (verl 0.9 skips it unless actor.calculate_entropy or "
                     "entropy_coeff != 0; verl 2025 ran it): write actor.calculate_entropy=False to price without")
        return
    on = calc in o and typed("entropy", o[calc], calc)
    if coeff in o:
        try:
            on = on or float(str(o[coeff]).strip("'\"")) != 0.0
        except ValueError:
            raise PlannerError(coeff, f"{o[coeff]!r} is not a number") from None
    knobs["entropy"] = on
