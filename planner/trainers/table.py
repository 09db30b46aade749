"""The trainers the planner plans for, as data: what each one runs and what its files can say.

A plan is only as good as the run it describes: the search proposes only what the chosen trainer can run
(planner/trainers/rules.py narrows the search space and refuses an explicit configuration it cannot express),
the cost model prices that trainer's defaults (its optimizer implementation, its loss, its kernels), and the
emitter writes that trainer's file (`artifacts`), which `fsdp-plan check` reads back as the same plan.

Each entry's facts are read from the trainer's own code at the version named, cited beside it. A new trainer is a
new entry plus an emitter / reader pair, not a branch in the search or the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from cost_models.specs import Sharding

ALL_SHARDINGS = tuple(Sharding)
FSDP2_SHARDINGS = ALL_SHARDINGS  # fully_shard: reshard True / False, a 2-D mesh for HYBRID, a shard group of 1
MESH_DIMS = ("tp", "cp", "ep", "pp")
CHECKPOINTING = ("none", "full", "every-k", "selective-op")
LAUNCHERS = ("torchrun", "slurm", "pytorchjob")  # launch lines: they run any trainer's script


@dataclass(frozen=True)
class Trainer:
    """One trainer at one version range: what it can run (the search's bounds) and its defaults (what is priced
    when the user does not say).

    mesh_dims: the degrees beyond data parallelism it can set above 1. sequence_parallel: with tp, the forms it
    runs (True: torchtitan's norms on sequence shards and loss parallel; False: transformers' tp_plan, logits
    gathered). checkpointing: of CHECKPOINTING ("every-k": one block in K, K >= 2). fsdp1_knobs: FSDP1's
    backward-prefetch and rate-limiter switches can be turned off. reshard_int: FSDP2's int
    reshard_after_forward. compile_scopes: "blocks" (each block compiled, the loss eager) and / or
    "blocks+loss"; the first is what it does when told to compile. float8: torchao's tensorwise Float8 linears
    (the recipe the cost model prices); fp8_all_gather: FSDP2 gathering them in FP8. defaults: request knob ->
    the trainer's own value, used where the user gives none (the optimizer's implementation, kernels)."""

    id: str
    title: str
    source: str
    artifacts: tuple[str, ...]
    model_impl: str = "transformers"
    fsdp_version: int = 2
    mesh_dims: tuple[str, ...] = ()
    sequence_parallel: tuple[bool, ...] = (True, False)
    shardings: tuple[Sharding, ...] = FSDP2_SHARDINGS
    checkpointing: tuple[str, ...] = CHECKPOINTING
    offload: bool = True
    fsdp1_knobs: bool = False
    reshard_int: bool = False
    compile_scopes: tuple[str, ...] = ("blocks", "blocks+loss")
    float8: bool = False
    fp8_all_gather: bool = False
    async_tp: bool = False
    lora: bool = True
    defaults: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    @property
    def own_artifact(self) -> str:
        return self.artifacts[0]

    def can_compile_loss(self) -> bool:
        return "blocks+loss" in self.compile_scopes


def _defaults(**values) -> MappingProxyType:
    return MappingProxyType(values)


TRAINERS: dict[str, Trainer] = {t.id: t for t in (
    Trainer(
        id="fsdp2", title="the planner's FSDP2 code",
        source="planner/emit/code/fsdp.py, mesh.py, pipeline.py (the code calibration/apply.py runs)",
        artifacts=("fsdp2", *LAUNCHERS), mesh_dims=MESH_DIMS, reshard_int=True, float8=True, fp8_all_gather=True,
        async_tp=True,
        # torch.optim.AdamW() with neither foreach nor fused: foreach on CUDA tensors (torch/optim/optimizer.py
        # _default_to_fused_or_foreach)
        defaults=_defaults(optimizer_impl="foreach")),
    Trainer(
        id="fsdp1", title="the planner's FSDP1 code",
        source="planner/emit/code/fsdp.py emit_fsdp1",
        artifacts=("fsdp1", *LAUNCHERS), fsdp_version=1, sequence_parallel=(True,), fsdp1_knobs=True, float8=True,
        defaults=_defaults(optimizer_impl="foreach")),
    Trainer(
        # transformers 5 Trainer on accelerate's FSDP2 plugin: fsdp_config keys (training_args.py), accelerate's
        # ParallelismConfig (dp_replicate, dp_shard, tp, cp: no ep, no pp), TP as transformers' tp_plan (no
        # sequence parallel), activation_checkpointing a bool (every block), reshard_after_forward a bool,
        # regional compilation of the blocks (the model's loss stays eager), the torchao Float8 recipe
        # (tensorwise, FP8 all-gather on under FSDP2); optim defaults to adamw_torch_fused (OptimizerNames)
        id="hf", title="HF Trainer / accelerate FSDP2",
        source="transformers 5 training_args.py (fsdp_config, optim), accelerate 1.x utils/dataclasses.py",
        artifacts=("hf-trainer", "accelerate-fsdp2", *LAUNCHERS), mesh_dims=("tp", "cp"), sequence_parallel=(False,),
        shardings=tuple(s for s in ALL_SHARDINGS if s is not Sharding.NO_SHARD),  # no shard group of 1 in FSDP2
        checkpointing=("none", "full"), compile_scopes=("blocks",), float8=True, fp8_all_gather=True,
        defaults=_defaults(optimizer_impl="fused")),
    Trainer(
        id="hf-fsdp1", title="HF Trainer / accelerate FSDP1",
        source="transformers/training_args.py (fsdp_config version 1), accelerate FSDP1 plugin",
        artifacts=("hf-trainer-fsdp1", "accelerate", *LAUNCHERS), fsdp_version=1, sequence_parallel=(True,),
        checkpointing=("none", "full"), fsdp1_knobs=True, compile_scopes=("blocks",), float8=True,
        defaults=_defaults(optimizer_impl="fused")),
    Trainer(
        # Lightning 2.x FSDPStrategy wraps FSDP1: activation_checkpointing_policy={Block} checkpoints every block,
        # compile and Float8 in configure_model (notes the emitter writes); configure_optimizers is the user's,
        # torch's default implementation (foreach on CUDA)
        id="lightning", title="Lightning FSDPStrategy (FSDP1)",
        source="lightning/pytorch/strategies/fsdp.py FSDPStrategy",
        artifacts=("lightning", *LAUNCHERS), fsdp_version=1, sequence_parallel=(True,), checkpointing=("none", "full"),
        fsdp1_knobs=True, compile_scopes=("blocks",), float8=True,
        defaults=_defaults(optimizer_impl="foreach")),
    Trainer(
        # torchtitan 0.3.0 (installed): parallelism.fsdp_reshard_after_forward default | always | never (no int);
        # activation-checkpoint:none | full | selective (per op; no every-K-th block); compile.components
        # ["model", "loss"] by default; Float8LinearConverter recipes "rowwise" | "rowwise_with_gw_hp" only, no FP8
        # all-gather (components/quantization/float8.py), which the cost model does not price: left out;
        # [optimizer] implementation defaults to "fused" (components/optimizer/optimizer.py); full models only
        id="torchtitan", title="torchtitan 0.3",
        source="torchtitan 0.3.0: config/configs.py, components/optimizer/optimizer.py, components/quantization/"
               "float8.py, distributed/activation_checkpoint.py",
        artifacts=("torchtitan", *LAUNCHERS), model_impl="torchtitan", mesh_dims=MESH_DIMS,
        checkpointing=("none", "full", "selective-op"), compile_scopes=("blocks+loss", "blocks"), async_tp=True,
        lora=False, defaults=_defaults(optimizer_impl="fused")),
    Trainer(
        # torchtitan 0.2: JobConfig TOML / --section.option flags; selective_ac_option "op" or K; Float8 tensorwise
        # with enable_fsdp_float8_all_gather; sequence parallel always on with TP; optimizer.implementation "fused"
        id="torchtitan-0.2", title="torchtitan 0.2",
        source="torchtitan 0.2 config/job_config.py (as planner/emit/torchtitan/job.py writes it)",
        artifacts=("torchtitan-0.2", *LAUNCHERS), model_impl="torchtitan", mesh_dims=MESH_DIMS,
        sequence_parallel=(True,), compile_scopes=("blocks+loss", "blocks"), float8=True, fp8_all_gather=True,
        async_tp=True, lora=False, defaults=_defaults(optimizer_impl="fused")),
)}

DEFAULT_TRAINER = "fsdp2"
