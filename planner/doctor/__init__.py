"""`fsdp-plan check`: price a user's existing FSDP setup and find what is wrong with it.

Each rule is a small function returning zero or more Findings: a severity (error: it will fail, train
wrongly or not fit; warning: it works but costs memory or speed, or relies on a misreading; advice: a
better choice exists), the reason in a sentence or two, and the fix as a config change. Many rules
correct advice found in blog posts (shared/seed/digest.md, "Corrections").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.evaluate import evaluate
from cost_models.feasibility import as_run, node_shard_group, refusals
from cost_models.memory import MemoryEstimate, estimate_memory
from cost_models.profile import DEFAULT_PROFILE, Profile
from cost_models.units import DTYPE_BYTES

from planner.api import Candidate, Plan
from planner.doctor.host_ways import full_state_dict_save, setup_ways
from planner.doctor.readers import UserSetup, model_use_cache
from planner.doctor.findings import ERROR, SEVERITY_ORDER, Context, Finding, _techniques
from planner.doctor.rules_settings import (fp16_scaler, lora_without_orig_params, lora_adapters_share_units,
                                           moe_all_linear_fsdp1, wrap_policy, hybrid_single_node, sync_module_states,
                                           forward_prefetch_dynamic, limit_all_gathers, fsdp2_removed_settings)
from planner.doctor.rules_mesh import cannot_run, mesh_rules_broken, pipeline_split, tp_across_nodes
from planner.doctor.rules_cost import (does_not_fit, micro_batch_headroom, slower_than_plan,
                                       kv_cache_with_checkpointing, reduce_in_low_precision)
from planner.doctor.rules_qlora import RULES as QLORA_RULES
from planner.doctor.rules_techniques import (float8_support, reshard_group, compile_dynamic_shapes,
                                             selective_op_unexpressed, checkpointing_outside_units, attention_unset)

RULES = (cannot_run, mesh_rules_broken, pipeline_split, tp_across_nodes, float8_support, reshard_group, compile_dynamic_shapes, selective_op_unexpressed,
         attention_unset, checkpointing_outside_units, does_not_fit, fp16_scaler, lora_without_orig_params,
         lora_adapters_share_units, moe_all_linear_fsdp1, wrap_policy,
         hybrid_single_node, sync_module_states, forward_prefetch_dynamic, limit_all_gathers, fsdp2_removed_settings,
         reduce_in_low_precision, kv_cache_with_checkpointing, micro_batch_headroom, slower_than_plan, *QLORA_RULES,
         full_state_dict_save)


def unwrapped_extra_bytes(setup: UserSetup, model, cluster, config, memory: MemoryEstimate) -> int:
    """Without a wrap policy the root is the only unit: the whole model is gathered in compute dtype."""
    if setup.wrap != "none" or config.shard_group_size(cluster) == 1:
        return 0
    c = DTYPE_BYTES[config.precision.compute_dtype]
    return max(0, model.n_params * c - memory.phases["backward"].unsharded_params)


def diagnose(setup: UserSetup, candidate: Candidate, plan: Plan | None, *, unwrapped_extra: int = 0,
             dynamic_control_flow: bool = False, profile: Profile | None = None,
             model_use_cache: bool | None = None) -> list[Finding]:
    """Run every rule. `candidate` is already priced as the user runs it (one unit when unwrapped, adding
    `unwrapped_extra` bytes)."""
    ctx = Context(setup=setup, candidate=candidate, model=candidate.model, cluster=candidate.cluster,
                  training=candidate.training, best=plan.best if plan else None,
                  best_same_techniques=next((c for c in plan.candidates if _techniques(c.config)
                                             == _techniques(candidate.config)), None) if plan else None,
                  dynamic_control_flow=dynamic_control_flow, unwrapped_extra_bytes=unwrapped_extra,
                  profile=profile or DEFAULT_PROFILE, model_use_cache=model_use_cache)
    findings = [f for rule in RULES for f in rule(ctx)]
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])


@dataclass
class CheckReport:
    setup: UserSetup
    candidate: Candidate
    findings: list[Finding]
    plan: Plan | None

    @property
    def has_errors(self) -> bool:
        return any(f.severity == ERROR for f in self.findings)

    def to_dict(self) -> dict:
        return {
            "model": self.candidate.model.summary_dict(),
            "source": self.setup.source,
            "fsdp_version": self.setup.fsdp_version,
            **self.candidate.to_dict(),
            "findings": [f.to_dict() for f in self.findings],
        }


def check(setup: UserSetup, model, gpus: int | None = None, *, gpus_per_node: int | None = None,
          micro_batch: int | None = None, grad_accum: int | None = None, dynamic_control_flow: bool = False,
          profile: Profile | None = None, seq_len: int | None = None, **cluster_and_training) -> CheckReport:
    """Estimate the user's setup on the cluster and run every rule. Cluster size defaults to the one the
    accelerate config names (num_processes, num_machines); seq_len to the setup's own (torchtitan's
    training.seq_len), else 2048."""
    from planner.api import RESOLVE_KNOBS, grad_accum_for, plan_for, raise_refused, replayed
    from planner.trainers import search_space, trainer_named, with_trainer_defaults
    from planner.request import build_request
    from planner.request.resolve import default_kernel_on
    from planner.errors import PlannerError

    if gpus is None:
        if setup.n_processes is None:
            raise PlannerError("gpus", "missing: pass --gpus N (the config does not name num_processes)")
        gpus = setup.n_processes
    if gpus_per_node is None and setup.n_machines:
        gpus_per_node = max(1, gpus // setup.n_machines)
    seq_len = seq_len or setup.seq_len or 2048
    trainer = trainer_named(trainer_of_setup(setup))  # the file's dialect names the trainer that runs it
    fixed = {k: v for k, v in setup.training if k not in cluster_and_training}  # what the file says (Automodel)
    request = with_trainer_defaults(build_request(model, gpus, valid=RESOLVE_KNOBS, gpus_per_node=gpus_per_node,
                                                  seq_len=seq_len, trainer=trainer.id, **fixed, **cluster_and_training),
                                    trainer)
    spec, cluster, training, attention = _with_attention(request, setup)
    mb = micro_batch or setup.config.micro_batch
    pipeline = setup.pipeline  # torchtitan's stages per rank from layers_per_stage need the model's blocks
    staged = {"pp_stages_per_rank": pipeline.stages_per_rank(spec.n_layers)} if pipeline is not None else {}
    # PYTORCH_CUDA_ALLOC_CONF: the flag's, else the setup's (no reader finds it in a launch script yet), else the
    # trainer's default (torchtitan's run_train.sh); the pipeline replay runs under it
    alloc_conf = (setup.config.alloc_conf if "alloc_conf" not in cluster_and_training and setup.config.alloc_conf
                  else request.alloc_conf or "")
    config = replace(setup.config, micro_batch=mb, **staged, **attention, alloc_conf=alloc_conf,
                     grad_accum=grad_accum or (grad_accum_for(mb, cluster, training, setup.config.model_parallel)
                                               if training.global_batch else setup.config.grad_accum))
    config = node_shard_group(config, cluster)  # a shard group of one node is the default's
    if setup.dialect == "automodel":  # its TE attention is its default, not a pin: off Hopper, flash2 as the API
        config = replace(config, attention_kernel=default_kernel_on(config.attention_kernel.value, cluster.gpu))
    setup = replace(setup, config=config)
    profile = profile or DEFAULT_PROFILE
    if not all(r.priced for r in refusals(cluster, config)):
        raise_refused(spec, cluster, training, config)  # cluster_rejects' PlannerError
    # priced even when it cannot run (rejected, with the reasons) so the report shows what it would need;
    # cannot_run explains. As run: without a wrap policy, as one unit; with the ways its files load and save
    ways = setup_ways(setup)
    memory = estimate_memory(spec, cluster, training, as_run(config, cluster), profile,
                             fsdp1_adapter_units=ways.fsdp1_adapter_units)
    extra = unwrapped_extra_bytes(setup, spec, cluster, config, memory)
    evaluation = evaluate(spec, cluster, training, config, profile, _as_one_unit(memory, extra, profile), ways)
    if not extra:  # the step replay walks the per-block units: a root-only unit keeps the flat rule
        evaluation = replayed(evaluation, spec, cluster, training, profile, ways)
    candidate = Candidate(evaluation, spec, cluster, training, trainer.id)
    # what the trainer could run
    best = plan_for(spec, cluster, training, profile, search_space(trainer, training), trainer.id, alloc_conf)
    findings = diagnose(setup, candidate, best, unwrapped_extra=extra, dynamic_control_flow=dynamic_control_flow,
                        profile=profile, model_use_cache=model_use_cache(model))
    return CheckReport(setup=setup, candidate=candidate, findings=findings, plan=best)


def _with_attention(request, setup: UserSetup) -> tuple:
    """(spec, cluster, training, {"attention": ...} or {}): the specs with the attention the setup runs (its block
    profile, where the model needs one, traced for it): the one the file sets, or transformers' default where it
    sets none (planner/emit/attention.py; rules_techniques.attention_unset says so); a setup whose reader or
    trainer fixes it (flags, kwargs, torchtitan, Automodel): as before."""
    from planner.api import model_attention, resolve_request
    from planner.emit.attention import transformers_default

    stated = setup.config.attention.value if setup.attention_from in ("code", "comment") else None
    spec, cluster, training = resolve_request(request, stated)
    if setup.source == "flags":  # no file, no --attention: what the planner runs (gpt-oss: flex, never SDPA)
        return spec, cluster, training, {"attention": spec.attention_choices[0]}
    if stated is not None:
        model_attention(spec, stated)  # one line where the model does not run it (gpt-oss: no SDPA)
    if setup.attention_from != "unstated":
        return spec, cluster, training, {}
    default = transformers_default(spec.attention_choices)
    if default != spec.attention_choices[0]:  # profiled for the first choice: again for the default
        spec, cluster, training = resolve_request(request, default)
    return spec, cluster, training, {"attention": default}


CODE_TRAINERS = {"fsdp2-code": "fsdp2", "fsdp1-code": "fsdp1", "lightning": "lightning"}  # dialect -> trainer


def trainer_of_setup(setup: UserSetup) -> str:
    """The trainer whose file was read (planner/trainers): accelerate and HF Trainer files by their FSDP version,
    torchtitan's by its spellings (0.3's config function / checkpointing subcommand), FSDP kwargs by FSDP1 or
    fully_shard names; flags: the planner's FSDP2 code."""
    from planner.doctor.readers.torchtitan import is_torchtitan_03
    from planner.trainers import DEFAULT_TRAINER

    if setup.dialect == "hf-trainer":
        return "hf" if setup.fsdp_version == 2 else "hf-fsdp1"
    if setup.dialect == "accelerate":
        return "accelerate-fsdp2" if setup.fsdp_version == 2 else "accelerate"
    if setup.dialect in ("automodel", "axolotl"):  # one trainer each
        return setup.dialect
    if setup.dialect == "torchtitan":
        return "torchtitan" if is_torchtitan_03(dict.fromkeys(setup.explicit)) else "torchtitan-0.2"
    if setup.dialect in CODE_TRAINERS:  # the planner's own snippets, read by planner/doctor/readers/python_code.py
        return CODE_TRAINERS[setup.dialect]
    return "fsdp1" if setup.dialect == "kwargs" and setup.fsdp_version == 1 else DEFAULT_TRAINER


def _as_one_unit(memory: MemoryEstimate, extra_bytes: int, profile: Profile) -> MemoryEstimate:
    """Without a wrap policy, the whole model is gathered at once: add it to the backward peak (reserved by the
    flat rule)."""
    if not extra_bytes:
        return memory
    backward = replace(memory.phases["backward"],
                       unsharded_params=memory.phases["backward"].unsharded_params + extra_bytes)
    phases = {**memory.phases, "backward": backward}
    phase, breakdown = max(phases.items(), key=lambda kv: kv[1].total_bytes)
    allocated = breakdown.total_bytes
    return replace(memory, breakdown=breakdown, peak_phase=phase, phases=phases, peak_allocated_bytes=allocated,
                   peak_reserved_bytes=profile.reserved_bytes(allocated, memory.outside_allocator_bytes),
                   notes=memory.notes + ("no auto-wrap policy: the whole model is one unit, gathered at once",))
