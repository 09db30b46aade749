"""Host RAM per node in every plan, estimate and check (issue 29 item 4): the breakdown in the text and the JSON,
the ways chosen with why, and --cpu-ram-per-node rejecting a candidate whose host peak does not fit.

Llama 3.1 8B (8,030,261,248 params; embedding 128,256 x 4,096) on one node of 8 H100s, bf16 with fp32 params:
- loading, rank 0 reads the published bf16 weights and broadcasts them: 8,030,261,248 x 2 B = 16,060,522,496 B on
  rank 0's node;
- save, DCP: 8 ranks x (10 MB copy-ahead + an eighth of the fp32 embedding, 262,668,288 B) = 2,181,346,304 B, and
  DCP's plans and metadata (outside_step.dcp_plan_bytes): 291 tensors (32 x 9 + 3), 873 sharded keys (each tensor
  and Adam's two states) and 303 written once (291 steps + 12 param_groups entries): 7,287 chunks, 1,176 keys;
  rank 0 2,996 x 7,287 + 4,713 x 1,176 + 303,402 = 27,677,742 B, the others 2,115 x 7,287 + 3,350 x 1,176 +
  136,588 = 19,488,193 B each: 164,095,093 B more, 2,345,441,397 B (2.2 GiB);
- resume, DCP: 8 x 2 items of 262,668,288 B = 4,202,692,608 B;
- processes: 8 x 282 MB = 2,256,000,000 B; the peak: processes + loading = 18,316,522,496 B (17.1 GiB).
"""

import json

from tests.cli.test_float_flags import invoke

BASE = ["--model", "llama3.1-8b", "--gpus", "8", "--gpu", "h100-80gb"]
HOST = {"load_bytes": 16_060_522_496, "checkpoint_save_bytes": 2_345_441_397, "resume_bytes": 4_202_692_608,
        "process_bytes": 2_256_000_000, "offloaded_bytes": 0, "peak_bytes": 18_316_522_496, "save_gpu_bytes": 0,
        "load_way": "rank0-broadcast", "save_way": "dcp", "resume_way": "meta-dcp"}


def test_estimate_json_carries_host_ram_per_node_by_phase(capsys):
    code, out, err = invoke(["estimate", *BASE, "--format", "json"], capsys)
    assert code == 0, err
    host = json.loads(out)["memory"]["host_ram"]
    assert {k: host[k] for k in HOST} == HOST
    assert "(every-rank: 119.7)" in host["why"]  # 8 x 16.1 GB: what rank-0 loading saves


def test_estimate_text_shows_the_host_breakdown_against_the_nodes_ram(capsys):
    code, out, err = invoke(["estimate", *BASE], capsys)
    assert code == 0, err
    text = " ".join(out.split())  # the lines are folded to the terminal width
    assert ("Host RAM per node: 17.1 GiB of 2048.0 GiB at its peak = processes 2.1 + the largest of loading 15.0, "
            "offloaded state 0.0 + checkpoint save 2.2 or + resume 3.9") in text
    assert "Load and checkpoint ways: load rank0-broadcast: 15.0 GiB on rank 0's node" in text


def test_a_node_without_the_ram_to_load_rejects_the_candidate(capsys):
    code, out, err = invoke(["estimate", *BASE, "--cpu-ram-per-node", "16GiB", "--format", "json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert not result["fits"]
    assert "needs 17 GiB of host RAM per node > 16 GiB (loading 15 GiB, processes 2.1 GiB)" in result["reasons"]


def test_plan_shows_host_ram_per_node_and_its_json_each_candidates(capsys):
    code, out, err = invoke([*BASE, "--top", "2"], capsys)
    assert code == 0, err
    assert "host GiB/node 17.1" in " ".join(out.split())
    assert "Host RAM per node: 17.1 GiB of 2048.0 GiB" in out
    code, out, err = invoke([*BASE, "--top", "2", "--format", "json"], capsys)
    assert code == 0, err
    assert all(c["memory"]["host_ram"]["peak_bytes"] == HOST["peak_bytes"] for c in json.loads(out)["candidates"])


def test_plan_on_a_node_too_small_to_load_fits_nothing_and_says_why(capsys):
    code, out, err = invoke([*BASE, "--cpu-ram-per-node", "16GiB", "--top", "1"], capsys)
    assert code == 0, err
    assert "Nothing fits" in out and "GiB of host RAM per node > 16 GiB" in " ".join(out.split())


# accelerate's FSDP1 defaults: every rank loads (no cpu_ram_efficient_loading), FULL_STATE_DICT saves and resumes
ACCELERATE_FSDP1 = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 8
mixed_precision: bf16
fsdp_config:
  fsdp_version: 1
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_use_orig_params: true
"""
# every rank loads the bf16 weights, 16,060,522,496 B: 8 x = 128,484,179,968 B; the save gathers fp32 params + Adam
# (3 x 32,121,044,992)
# and offload_to_cpu's copy of the root unit (embedding + head + norm, 1,050,677,248 x 4 B = 4,202,708,992 B, also
# the GPU transient) on rank 0; resume: every rank of an FSDP1 model reads params + Adam, 8 x 96,363,134,976 B.
CHECKED = {"load_bytes": 128_484_179_968, "checkpoint_save_bytes": 100_565_843_968, "save_gpu_bytes": 4_202_708_992,
           "resume_bytes": 770_905_079_808, "peak_bytes": 773_161_079_808, "load_way": "every-rank",
           "save_way": "full-state-dict", "resume_way": "every-rank"}


def test_check_prices_the_files_load_and_save_ways(tmp_path, capsys):
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_FSDP1)
    code, out, err = invoke(["check", str(path), "--model", "llama3.1-8b", "--gpu", "h100-80gb", "--format", "json"],
                            capsys)
    assert code == 0, err
    report = json.loads(out)
    host = report["memory"]["host_ram"]
    assert {k: host[k] for k in CHECKED} == CHECKED
    assert {f["code"]: f["severity"] for f in report["findings"]}["full-state-dict-save"] == "warning"
    code, out, err = invoke(["check", str(path), "--model", "llama3.1-8b", "--gpu", "h100-80gb",
                             "--cpu-ram-per-node", "512GiB"], capsys)
    assert "[ERROR] host-ram-does-not-fit: Out of memory: needs 720 GiB of host RAM per node > 512 GiB" in out
    assert "Host RAM per node: 720.1 GiB of 512.0 GiB" in out


def test_the_emitted_fsdp2_snippet_reads_back_with_the_plans_ways(tmp_path, capsys):
    """--emit fsdp2 writes load_pretrained (broadcast_from_rank0) and DCP save / load: check prices those."""
    code, out, err = invoke([*BASE, "--emit", "fsdp2"], capsys)
    assert code == 0, err
    assert "broadcast_from_rank0=True" in out and "dcp.save(" in out and "dcp.load(" in out
    path = tmp_path / "train.py"
    path.write_text(out)
    code, out, err = invoke(["check", str(path), *BASE, "--format", "json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    host = report["memory"]["host_ram"]
    assert (host["load_way"], host["save_way"], host["resume_way"]) == ("rank0-broadcast", "dcp", "meta-dcp")
    assert host["peak_bytes"] == HOST["peak_bytes"]
    assert "missing-sync-module-states" not in {f["code"] for f in report["findings"]}


def test_the_trainer_sets_the_ways_its_artifact_loads_and_saves(capsys):
    """torchtitan builds on meta and reads its checkpoint with DCP: each rank one item of the embedding at a time,
    8 x 262,668,288 B on the node, not rank 0's 16 GB; Lightning's FSDPStrategy as emitted has every rank load the
    model (8 x 16,060,522,496 B) and saves sharded."""
    ways = {}
    for trainer in ("torchtitan", "lightning"):
        code, out, err = invoke(["estimate", *BASE, "--trainer", trainer, "--format", "json"], capsys)
        assert code == 0, err
        ways[trainer] = json.loads(out)["memory"]["host_ram"]
    assert (ways["torchtitan"]["load_way"], ways["torchtitan"]["load_bytes"]) == ("meta-dcp", 8 * 262_668_288)
    assert (ways["lightning"]["load_way"], ways["lightning"]["load_bytes"]) == ("every-rank", 128_484_179_968)
    assert ways["lightning"]["save_way"] == "dcp"


# A user's script (issue 29): transformers' model, FSDP2 by hand, and HF's save at the end
SAVE_PRETRAINED_SCRIPT = """import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B")
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model.model.layers:
    fully_shard(block, mp_policy=mp)
fully_shard(model, mp_policy=mp)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
# ... the training loop ...
model.save_pretrained("out")
"""


def test_check_prices_a_scripts_save_pretrained_as_rank_0s_gathered_params(tmp_path, capsys):
    """save_pretrained gathers the fp32 params on rank 0: 4 x 8,030,261,248 = 32,121,044,992 B on its node, one
    tensor at a time on the GPU under FSDP2 (the fp32 embedding, 128,256 x 4,096 x 4 = 2,101,346,304 B); read back
    whole (rank 0 + broadcast under FSDP2)."""
    path = tmp_path / "train.py"
    path.write_text(SAVE_PRETRAINED_SCRIPT)
    code, out, err = invoke(["check", str(path), *BASE, "--format", "json"], capsys)
    assert code == 0, err
    host = json.loads(out)["memory"]["host_ram"]
    assert (host["save_way"], host["resume_way"]) == ("save-pretrained", "rank0-broadcast")
    assert (host["checkpoint_save_bytes"], host["save_gpu_bytes"]) == (32_121_044_992, 2_101_346_304)


def test_a_scripts_hf_save_sets_the_save_way_and_a_gather_outranks_dcp():
    from planner.doctor.readers.python_ast import Snippet
    from planner.doctor.readers.python_checkpoint import checkpoint_fields

    def save_of(code: str) -> str | None:
        snippet = Snippet("import torch.distributed.checkpoint as dcp\n" + code, "t.py")
        return checkpoint_fields(snippet)["state_dict_type"]

    assert save_of("trainer.save_model()\n") == "SAVE_PRETRAINED"
    assert save_of("accelerator.unwrap_model(model).save_pretrained('out')\n") == "SAVE_PRETRAINED"
    assert save_of("dcp.save(state, checkpoint_id='ck')\n") == "SHARDED_STATE_DICT"
    # periodic DCP checkpoints and a final save_pretrained: rank 0's gather sets the host peak
    assert save_of("dcp.save(state, checkpoint_id='ck')\nmodel.save_pretrained('out')\n") == "SAVE_PRETRAINED"
    assert save_of("x = 1\n") is None


# --trainer fsdp1's ways (every rank loads; DCP save and resume through get_state_dict / set_state_dict, each state
# dict made on host), and the same ways read back from accelerate's FSDP1 config with SHARDED_STATE_DICT (its
# ShardedStateDictConfig / ShardedOptimStateDictConfig default to offload_to_cpu=True)
FSDP1_8B = ["--model", "llama3.1-8b", "--gpus", "8", "--gpu", "rtx4090-24gb", "--activation-checkpointing", "full",
            "--micro-batch", "1", "--seq-len", "2048"]
RESUME_REASON = "needs 36.0 GiB per GPU > 24.0 GiB (peak in the meta-dcp resume)"
RESUME_NOTE = "the meta-dcp resume holds 20.7 GiB allocated per GPU, above the step's peak"
# the resume through a host state dict: on the GPU the root's params (embedding, head, norm: 4,202,708,992 B in fp32)
# gathered and unsharded beside a block's (872,448,000 B) = 10,150,313,984 B; on host, per rank, the copy of the
# shard (12,045,391,872 B) beside the new Adam shard (8,030,261,248) and the embedding's two states (4,202,692,608):
# 8 x 24,278,345,728 B on the node. Loading: two copies of the root unit (FSDP1 flattens it beside the originals).
FSDP1_HOST = {"resume_gpu_bytes": 10_150_313_984, "resume_bytes": 194_226_765_824, "save_gpu_bytes": 4_202_708_992,
              "load_gpu_bytes": 8_405_417_984}


def test_an_fsdp1_resume_through_a_host_state_dict_fits_in_estimate_check_and_plan(tmp_path, capsys):
    """Llama 3.1 8B, full fine-tuning, 8 x RTX 4090: the step peaks at 20.3 GiB allocated; the resume through a host
    state dict at 22,195,705,856 B = the fp32 params' and Adam's shards (4,015,130,624 + 8,030,261,248 B) +
    10,150,313,984 (FSDP1_HOST): 20.7 GiB, above the step's peak (a note), within the GPU. estimate and check of
    accelerate's config agree; the search finds configurations on 8 of them."""
    code, out, err = invoke(["estimate", *FSDP1_8B, "--trainer", "fsdp1", "--format", "json"], capsys)
    assert code == 0, err
    estimated = json.loads(out)
    assert (estimated["fits"], estimated["reasons"]) == (True, [])
    assert RESUME_NOTE in estimated["memory"]["notes"]
    host = estimated["memory"]["host_ram"]
    assert {k: host[k] for k in FSDP1_HOST} == FSDP1_HOST
    assert "resume meta-dcp through a state dict on host: 180.9 GiB" in host["why"]
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_FSDP1 + "  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
                    "  fsdp_activation_checkpointing: true\n")
    code, out, err = invoke(["check", str(path), *FSDP1_8B[:2], *FSDP1_8B[4:6], *FSDP1_8B[8:], "--format", "json"],
                            capsys)
    checked = json.loads(out)
    assert (checked["fits"], checked["reasons"]) == (True, []), err
    assert {k: checked["memory"]["host_ram"][k] for k in FSDP1_HOST} == FSDP1_HOST
    assert checked["memory"]["peak_allocated_bytes"] == estimated["memory"]["peak_allocated_bytes"]
    from planner import plan

    assert plan("llama3.1-8b", 8, gpu="rtx4090-24gb", trainer="fsdp1").best.fits  # b88311c: nothing fitted


def test_check_reads_whether_a_scripts_fsdp1_resume_gets_its_state_dict_on_host(tmp_path, capsys):
    """--emit fsdp1's script reads back with both state dicts on host; the same script whose load_checkpoint calls
    get_state_dict without cpu_offload (as --emit fsdp1 wrote it before) resumes on the GPU: the copy of the shard
    and the new states there, 24,278,345,728 B (12,045,391,872 + 8,030,261,248 + 4,202,692,608) beside the
    12,045,391,872 B resident: 33.8 GiB allocated, 36.0 reserved > 24 GiB, refused; its save keeps its cpu_offload."""
    code, script, err = invoke([*FSDP1_8B[:6], "--trainer", "fsdp1", "--emit", "fsdp1"], capsys)
    assert code == 0, err
    load = "    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)\n    state = {"
    assert script.count("options = StateDictOptions(cpu_offload=True)") == 2 and script.count(load) == 1
    checked = {}
    for name, text in (("host", script), ("gpu", script.replace(load, load.replace(", options=options", "")))):
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        code, out, err = invoke(["check", str(path), *FSDP1_8B[:6], "--format", "json"], capsys)
        checked[name] = json.loads(out)
    assert checked["host"]["fits"] and {k: checked["host"]["memory"]["host_ram"][k] for k in FSDP1_HOST} == FSDP1_HOST
    gpu = checked["gpu"]
    assert (gpu["fits"], gpu["reasons"]) == (False, [RESUME_REASON])
    assert (gpu["memory"]["host_ram"]["resume_gpu_bytes"], gpu["memory"]["host_ram"]["save_gpu_bytes"]) == (
        24_278_345_728, 4_202_708_992)
