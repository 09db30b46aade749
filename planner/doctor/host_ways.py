"""The ways a user's files load and save, as cost_models/host_ram.Ways: check evaluates the setup with them (host
RAM, and the GPU transients of those ways where they pass the step's peak: cost_models/evaluate.py) - every rank
loading (no cpu_ram_efficient_loading / sync_module_states), a FULL_STATE_DICT save gathered on rank 0 (accelerate's
default under FSDP1), FSDP1's copy of the shard in a DCP resume."""

from __future__ import annotations

from cost_models.host_ram import Ways
from cost_models.outside_step import LoadWay, SaveWay
from cost_models.units import GiB

# UserSetup.init -> how the weights are read: meta-device ranks receive rank 0's weights by sync_module_states
LOAD_WAYS = {"all": LoadWay.EVERY_RANK, "rank0": LoadWay.RANK0_BROADCAST, "meta": LoadWay.RANK0_BROADCAST,
             "dcp": LoadWay.META_DCP}  # dcp: meta-device init, then a sharded checkpoint (torchtitan)
# UserSetup.state_dict_type -> the save; unstated: the plan's sharded DCP save
SAVE_WAYS = {"FULL_STATE_DICT": SaveWay.FULL_RANK0, "SHARDED_STATE_DICT": SaveWay.DCP, "LOCAL_STATE_DICT": SaveWay.DCP,
             "ASYNC_SHARDED_STATE_DICT": SaveWay.DCP_ASYNC,  # torchtitan's checkpoint.async_mode async*
             "SAVE_PRETRAINED": SaveWay.SAVE_PRETRAINED}  # a script's model.save_pretrained / trainer.save_model


def setup_ways(setup) -> Ways:
    """How the setup's files load the weights, save and resume (check prices host RAM and the GPU with them)."""
    load_way = LOAD_WAYS.get(setup.init, LoadWay.EVERY_RANK)
    save_way = SAVE_WAYS.get(setup.state_dict_type or "", SaveWay.DCP)
    # a full checkpoint is read back whole (accelerate's load_fsdp_model / load_fsdp_optimizer: by every rank of
    # an FSDP1 model, by rank 0 with broadcast_from_rank0 under FSDP2), a sharded one with DCP; save_pretrained's
    # too (priced with the optimizer state, which it does not save: a bound)
    full_resume = LoadWay.RANK0_BROADCAST if setup.fsdp_version == 2 else LoadWay.EVERY_RANK
    full = save_way in (SaveWay.FULL_RANK0, SaveWay.SAVE_PRETRAINED)
    return Ways(load_way, save_way, full_resume if full else LoadWay.META_DCP, fsdp2=setup.fsdp_version == 2,
                save_state_dict_on_host=setup.save_state_dict_on_host,
                resume_state_dict_on_host=setup.resume_state_dict_on_host, fsdp1_adapter_units=setup.adapter_units)


def full_state_dict_save(ctx):
    """A FULL_STATE_DICT save gathers the whole state on rank 0's host at every checkpoint."""
    from planner.doctor.findings import WARNING, Finding

    host = ctx.candidate.memory.host_ram
    if host is None or host.save_way is not SaveWay.FULL_RANK0:
        return
    yield Finding("full-state-dict-save", WARNING,
                  f"FULL_STATE_DICT gathers the params and optimizer state on rank 0 at every save: "
                  f"{host.save_bytes / GiB:.1f} GiB of host RAM on its node"
                  + (f" and {host.save_gpu_bytes / GiB:.1f} GiB per GPU" if host.save_gpu_bytes else ""),
                  "state_dict_type SHARDED_STATE_DICT: each rank writes its own shard (DCP), nothing gathered")
