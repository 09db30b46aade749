"""`fsdp-plan check` of RL jobs: a verl launch script (and its overrides / YAML forms), a TRL GRPOConfig. Round
trips: `rl estimate --emit verl|trl` read back by check prices the same phases, byte for byte; verl's own example
script of rl.md golden case 1 reads and fits; bad input is one line naming the key, exit 2."""

import json
import os
from unittest import mock

import pytest

from cost_models.rl_schedule import TRL_SETS
from cost_models.units import GiB
from planner.doctor.readers import read_rl_setup
from planner.emit.trl import emit_trl
from planner.emit.verl import emit_verl
from planner.rl import rl_estimate
from planner.rl.report import rl_dict
from planner.schemas.rl import RlEstimateOutput
from tests.doctor.cli_run import cli_process, run_cli

CASE_1 = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=1024, ppo_mini_batch_size=256,
              ppo_micro_batch_size_per_gpu=16, rollout_n=5, param_offload=True, optimizer_offload=True,
              rollout_tp=2, gpu_memory_utilization=0.6, engine_version="0.8", enforce_eager=True, max_num_seqs=1024,
              mean_prompt_len=100, mean_response_len=300)

# verl's examples/tuning/7b/qwen2-7b_grpo_2_h800_fsdp_vllm.sh (April 2025; shared/reference/rl.md case 1): its keys
# and values as the script has them, the shell variables included
VERL_EXAMPLE = r"""set -x

gsm8k_train_path=$HOME/data/rlhf/gsm8k/train.parquet
gsm8k_test_path=$HOME/data/rlhf/math/test.parquet
model_path=Qwen/Qwen2-7B-Instruct

train_files="['$gsm8k_train_path']"
test_files="['$gsm8k_test_path']"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$train_files" \
    data.val_files="$test_files" \
    data.train_batch_size=1024 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=$model_path \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger=['console','wandb'] \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=2 \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""


def run(*args):
    with mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1"}):
        return cli_process(["check", *map(str, args)])


def same_memory(checked: dict, estimate) -> None:
    RlEstimateOutput.model_validate(checked)
    planned = rl_dict(estimate)["memory"]
    for key in ("peak_reserved_bytes", "peak_phase", "cpu_bytes_per_node", "phases"):
        assert checked["memory"][key] == planned[key], key


# PPO (a critic) with a LoRA FSDP2 bf16 actor, dynamic batches, Ulysses 2, SGLang, 2 nodes; and TRL with LoRA
PPO = dict(gpu="h100-80gb", gpus_per_node=8, prompt_len=1024, response_len=2048, train_batch=256, rollout_n=4,
           algorithm="ppo", strategy="fsdp2", actor_dtype="bf16", finetune="lora", lora_rank=64,
           use_dynamic_bsz=True, ppo_max_token_len_per_gpu=16384, ulysses_sequence_parallel_size=2,
           critic_param_offload=True, engine="sglang", cpu_ram_per_node="1TiB")
# TRL: case 1 less the engine knobs TRL sets itself (cost_models/rl_schedule.py TRL_SETS: vLLM >= 0.22, TRL's
# max_num_seqs, CUDA graphs on); its GRPOConfig keys: TRL's defaults, or a reference, two iterations and sleep mode
TRL_CASE_1 = dict({k: v for k, v in CASE_1.items() if k not in TRL_SETS}, framework="trl", strategy="fsdp2")
TRL_LORA = dict(TRL_CASE_1, finetune="lora", lora_rank=16, actor_dtype="bf16", param_offload=False,
                optimizer_offload=False, gradient_checkpointing=False)
TRL_PASSES = dict(TRL_CASE_1, param_offload=False, optimizer_offload=False, beta=0.04, num_iterations=2,
                  vllm_importance_sampling_correction=False, vllm_enable_sleep_mode=True)
# FSDP2's CPUOffloadPolicy (fsdp_config.offload_policy): the actor's states on the host
OFFLOAD_POLICY = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=64, rollout_n=8,
                      strategy="fsdp2", actor_dtype="bf16", offload_policy=True)
# LoRA merged at each weight sync (model.lora.merge): the engine at level 2, the merge's host backup
LORA_MERGE = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=64, rollout_n=8, finetune="lora",
                  lora_merge=True)
# PPO's critic under its own CPUOffloadPolicy (critic.fsdp.offload_policy), its CPU step priced at 8 threads a rank
CRITIC_POLICY = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=64, rollout_n=8,
                     strategy="fsdp2", algorithm="ppo", critic_offload_policy=True, omp_num_threads=8)
# attention-only LoRA (model.target_modules, --lora-targets): an MoE served by SGLang; TRL's in its fsdp-plan line
ATTENTION_LORA = dict(LORA_MERGE, lora_merge=False, strategy="fsdp2", engine="sglang", lora_targets="attention")
TRL_ATTENTION = dict(TRL_LORA, lora_targets="attention")


@pytest.mark.parametrize("emit, name, model, gpus, knobs", [
    (emit_verl, "job.sh", "qwen2-7b", 2, CASE_1), (emit_trl, "grpo.yaml", "qwen2-7b", 2, TRL_CASE_1),
    (emit_verl, "ppo.sh", "qwen2.5-7b", 16, PPO), (emit_trl, "lora.yaml", "qwen2-7b", 2, TRL_LORA),
    (emit_verl, "policy.sh", "qwen2.5-7b", 8, OFFLOAD_POLICY), (emit_trl, "passes.yaml", "qwen2-7b", 2, TRL_PASSES),
    (emit_verl, "critic.sh", "qwen2.5-7b", 8, CRITIC_POLICY), (emit_verl, "merge.sh", "qwen2.5-7b", 8, LORA_MERGE),
    (emit_verl, "attention.sh", "qwen3-30b-a3b", 8, ATTENTION_LORA),
    (emit_trl, "attention.yaml", "qwen2-7b", 2, TRL_ATTENTION)],
    ids=["verl-case-1", "trl-case-1", "verl-ppo-lora", "trl-lora", "verl-offload-policy", "trl-passes",
         "verl-critic-policy", "verl-lora-merge", "verl-attention-lora", "trl-attention-lora"])
def test_emit_then_check_prices_the_same_phases(tmp_path, emit, name, model, gpus, knobs):
    """Written by --emit and read back: every phase's bytes equal, the peak and host RAM too (case 1's peak: the
    weight sync, 77.97 GiB; tests/golden/test_rl_cases.py)."""
    e = rl_estimate(model, gpus, **knobs)
    (tmp_path / name).write_text(emit(e))
    r = run(tmp_path / name, "--format", "json")
    assert r.returncode == (0 if e.fits else 1), r.stderr   # TRL's engine awake beside the update: 1 for case 1
    same_memory(json.loads(r.stdout), e)


def test_the_searchs_best_emitted_then_checked_prices_the_same(tmp_path):
    """`fsdp-plan rl --emit verl` writes the best configuration of the issue's job on 8 x H100 (its dtype, offloads,
    checkpointing, entropy chunking, Ulysses degree, both micro-batches, TP, utilization and max_num_seqs as
    searched); check reads every searched knob back and prices the same phases and the same step time, exactly."""
    from planner.rl.request import rl_request
    from planner.rl.search import plan_rl

    best = plan_rl(rl_request("qwen2.5-7b", 8, gpu="h100-80gb", prompt_len=1024, response_len=4096, rollout_n=8,
                              train_batch=256), top=1).ranked[0]
    (tmp_path / "best.sh").write_text(emit_verl(best))
    checked = json.loads(run_cli(["check", str(tmp_path / "best.sh"), "--format", "json"]))
    same_memory(checked, best)
    planned = rl_dict(best)
    assert checked["knobs"] == planned["knobs"] and checked["time"] == planned["time"]


def test_verls_own_example_reads_and_fits(tmp_path):
    """Golden case 1 as verl ships it. The model path is a Hub id not on this machine: --model names the preset;
    the script cannot say the vLLM version (0.8.2) nor GSM8K's lengths: given as flags. verl 0.9's defaults fill
    the rest (max_num_seqs 256, CUDA graphs on): the peak is the weight sync, 77.97 GiB as in the golden case (FSDP1's
    state-dict copy beside the woken engine) plus the engine's CUDA-graph pool (0.5 GiB, an estimate:
    rollout_engine.py) and what vLLM 0.8's KV cache gains from a profile-run sampler of 256 rows, not 1,024 (2 x 768
    x 152,064 x 4 B = 0.87 GiB): 79.34 of 79.65 GiB."""
    (tmp_path / "run.sh").write_text(VERL_EXAMPLE)
    r = run(tmp_path / "run.sh", "--model", "qwen2-7b", "--gpu", "h100-80gb", "--engine-version", "0.8",
            "--mean-prompt-len", 100, "--mean-response-len", 300, "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fits"] and out["memory"]["peak_phase"] == "weight_sync"
    assert out["memory"]["peak_reserved_bytes"] / GiB == pytest.approx(77.97 + 0.5 + 0.87, abs=0.01)
    same_memory(out, rl_estimate("qwen2-7b", 2, **{**CASE_1, "enforce_eager": False, "max_num_seqs": 256}))
    assert any("priced with the entropy" in n for n in out["notes"])   # neither entropy key in the script


def test_the_example_without_model_names_the_key(tmp_path):
    (tmp_path / "run.sh").write_text(VERL_EXAMPLE)
    r = run(tmp_path / "run.sh")
    assert r.returncode == 2
    assert "actor_rollout_ref.model.path" in r.stderr and "--model" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_an_unset_variable_names_its_key(tmp_path):
    (tmp_path / "run.sh").write_text(VERL_EXAMPLE.replace("rollout.n=5", "rollout.n=$N"))
    r = run(tmp_path / "run.sh", "--model", "qwen2-7b")
    assert r.returncode == 2
    assert "actor_rollout_ref.rollout.n" in r.stderr and "$N" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_overrides_yaml_and_script_read_alike(tmp_path):
    """The same job as a bare override list and as verl's nested YAML: the same knobs as the script (by hand:
    256 x 5 / 2 GPUs = 640 sequences a rank per mini-batch, 16 a micro-batch)."""
    script = tmp_path / "run.sh"
    script.write_text(VERL_EXAMPLE)
    bare = tmp_path / "overrides.txt"
    bare.write_text("\n".join(line.strip(" \\") for line in VERL_EXAMPLE.splitlines() if line.startswith("    "))
                    .replace("$model_path", "Qwen/Qwen2-7B-Instruct").replace(" $@", ""))
    nested = {"algorithm": {"adv_estimator": "grpo"}, "data": {"train_batch_size": 1024, "max_prompt_length": 1024,
                                                               "max_response_length": 1024},
              "actor_rollout_ref": {"model": {"path": "Qwen/Qwen2-7B-Instruct", "use_remove_padding": True,
                                              "enable_gradient_checkpointing": True},
                                    "actor": {"ppo_mini_batch_size": 256, "ppo_micro_batch_size_per_gpu": 16,
                                              "fsdp_config": {"param_offload": True, "optimizer_offload": True}},
                                    "rollout": {"log_prob_micro_batch_size_per_gpu": 16, "name": "vllm",
                                                "tensor_model_parallel_size": 2, "gpu_memory_utilization": 0.6,
                                                "n": 5},
                                    "ref": {"fsdp_config": {"param_offload": True}}},
              "trainer": {"n_gpus_per_node": 2, "nnodes": 1}}
    as_yaml = tmp_path / "job.yaml"
    as_yaml.write_text(json.dumps(nested))   # JSON is YAML
    read = [read_rl_setup(p) for p in (script, bare, as_yaml)]
    assert [s.dialect for s in read] == ["verl-script", "verl-overrides", "verl-yaml"]
    assert read[0].knobs == read[1].knobs == read[2].knobs
    assert read[0].model_path == "Qwen/Qwen2-7B-Instruct"
    k = read[0].knobs
    assert (k["train_batch"], k["ppo_mini_batch_size"], k["ppo_micro_batch_size_per_gpu"], k["rollout_n"]) == (
        1024, 256, 16, 5)
    assert (k["gpus"], k["rollout_tp"], k["gpu_memory_utilization"], k["param_offload"]) == (2, 2, 0.6, True)


def test_verls_micro_batch_assert_is_a_finding(tmp_path):
    """verl asserts the normalized mini-batch (256 x 5 / 2 = 640) divisible by the micro-batch: 48 does not
    (640 = 13 x 48 + 16); check says so and exits 1. verl 0.9.1 asserts it in its split of the rank's mini-batch
    (workers/engine/utils.prepare_micro_batches), not in validate_config: both run in tests/cli/test_rl_emit.py."""
    (tmp_path / "run.sh").write_text(VERL_EXAMPLE.replace("ppo_micro_batch_size_per_gpu=16",
                                                          "ppo_micro_batch_size_per_gpu=48"))
    r = run(tmp_path / "run.sh", "--model", "qwen2-7b", "--format", "json")
    assert r.returncode == 1
    assert any(reason.startswith("ppo_micro_batch_size_per_gpu") for reason in json.loads(r.stdout)["reasons"])


def test_a_utilization_that_leaves_the_trainer_no_room_names_the_one_that_fits():
    """Case 1 at gpu_memory_utilization 0.9 (vLLM 0.8): the weight sync holds the fp32 actor (14.19 GiB) and FSDP1's
    state-dict copy of it (14.19 GiB, rl_strategy.py) beside the engine's 62.1 GiB KV cache, 109,376,415,129 B >
    85,520,809,984 B. The KV cache shrinks byte for byte with the utilization (0.01 less: 855,113,728 B), so the note
    names 0.62 (85,430,936,985 B), which fits, and 0.63 (86,286,050,713 B) does not."""
    e = rl_estimate("qwen2-7b", 2, **{**CASE_1, "gpu_memory_utilization": 0.9})
    assert not e.fits and e.memory.phases[2].reserved_bytes == 109_376_415_129
    note = next(n for n in e.notes if n.startswith("gpu_memory_utilization 0.9"))
    assert "in weight_sync" in note and "--gpu-memory-utilization 0.62 " in note
    assert rl_estimate("qwen2-7b", 2, **{**CASE_1, "gpu_memory_utilization": 0.62}).fits
    assert not rl_estimate("qwen2-7b", 2, **{**CASE_1, "gpu_memory_utilization": 0.63}).fits


def test_keys_left_out_take_verls_defaults(tmp_path):
    """verl 0.9's _generated_ppo_trainer.yaml: prompts and responses 512, train batch 1024, n 1, mini-batch 256, the
    reference not offloaded, adv_estimator gae (PPO: a critic). Without a micro-batch verl asserts: one line."""
    from planner.errors import PlannerError

    path = tmp_path / "o.txt"
    path.write_text("actor_rollout_ref.rollout.name=vllm actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    k = read_rl_setup(path).knobs
    assert (k["prompt_len"], k["response_len"], k["train_batch"], k["rollout_n"], k["ppo_mini_batch_size"]) == (
        512, 512, 1024, 1, 256)
    assert (k["ref_param_offload"], k["algorithm"], k["gpus"]) == (False, "ppo", 8)
    assert k["critic_ulysses_sequence_parallel_size"] == 1   # dp_critic.yaml's, whatever the actor runs
    assert (k["critic_strategy"], k["critic_dtype"]) == ("fsdp", "fp32")   # dp_critic.yaml's, engine/fsdp.yaml's
    path.write_text("actor_rollout_ref.rollout.name=vllm")
    with pytest.raises(PlannerError, match="actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"):
        read_rl_setup(path)


def test_a_grpo_config_alone_needs_the_gpu_count(tmp_path):
    """TRL counts its batch per process: case 1's GRPOConfig as JSON (no accelerate document, no fsdp-plan line)
    reads back to 160 x 16 x 2 / 5 = 1,024 prompts a step and 40 x 16 x 2 / 5 = 256 a mini-batch only once --gpus
    says 2; without it, one line naming gpus."""
    import yaml

    from planner.errors import PlannerError

    grpo = next(yaml.safe_load_all(emit_trl(rl_estimate("qwen2-7b", 2, **CASE_1))))
    path = tmp_path / "grpo.json"
    path.write_text(json.dumps(grpo))
    with pytest.raises(PlannerError, match="gpus"):
        read_rl_setup(path)
    k = read_rl_setup(path, gpus=2).knobs
    assert (k["train_batch"], k["ppo_mini_batch_size"], k["rollout_n"], k["prompt_len"]) == (1024, 256, 5, 1024)
    assert (k["actor_dtype"], k["gradient_checkpointing"], k["gpu_memory_utilization"]) == ("fp32", True, 0.6)


def test_a_value_verl_cannot_take_is_named_by_its_key(tmp_path):
    """rollout.name hf: the cost model's one line (vllm, sglang), named by verl's key, exit 2."""
    (tmp_path / "run.sh").write_text(VERL_EXAMPLE.replace("rollout.name=vllm", "rollout.name=hf"))
    r = run(tmp_path / "run.sh", "--model", "qwen2-7b")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: actor_rollout_ref.rollout.name: unknown value 'hf'; choose one of: vllm, sglang"


def test_a_critic_left_at_ulysses_1_is_priced_at_its_own_degree(tmp_path):
    """The PPO script as --emit verl writes it, but the critic's Ulysses key dropped (verl runs its default 1 while
    the actor runs 2): check prices the critic's update at 1 - each GPU holds a whole micro-batch's sequences, not
    half - and every other phase as before: the critic's update at Ulysses 1 is the estimate asked for that degree,
    and above the one at the actor's 2. (With dynamic batches, PPO's own setting, each GPU packs its token budget
    whatever the degree: the same bytes.)"""
    assert rl_estimate("qwen2.5-7b", 16, critic_ulysses_sequence_parallel_size=1, **PPO).memory.phases == \
        rl_estimate("qwen2.5-7b", 16, **PPO).memory.phases
    static = dict(PPO, use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=4)
    e = rl_estimate("qwen2.5-7b", 16, **static)
    script = emit_verl(e)
    line = "    critic.ulysses_sequence_parallel_size=2 \\\n"
    assert line in script
    (tmp_path / "ppo.sh").write_text(script.replace(line, ""))
    checked = {p["name"]: p["reserved_bytes"] for p in json.loads(run(tmp_path / "ppo.sh", "--format",
                                                                          "json").stdout)["memory"]["phases"]}
    own = {p.name: p.reserved_bytes for p in rl_estimate("qwen2.5-7b", 16, critic_ulysses_sequence_parallel_size=1,
                                                         **static).memory.phases}
    planned = {p.name: p.reserved_bytes for p in e.memory.phases}
    assert checked == own and checked["critic_update"] > planned["critic_update"]
    assert {n: b for n, b in checked.items() if n != "critic_update"} == {
        n: b for n, b in planned.items() if n != "critic_update"}


def test_the_critics_offload_policy_and_the_workers_threads_read_from_verls_keys(tmp_path):
    """critic.fsdp.offload_policy and Ray's job-wide OMP_NUM_THREADS (what --emit verl writes for a CPU step: the
    workers' threads) are read from verl's own keys, the `# fsdp-plan:` line's --omp-num-threads dropped: the same
    host RAM and step time. verl reads the critic's policy under critic.strategy fsdp2 only (its default is fsdp):
    with the key dropped the critic is priced as FSDP1's without it (the plan without the policy, under the same
    strategies), and said."""
    e = rl_estimate("qwen2.5-7b", 8, **CRITIC_POLICY)
    script = emit_verl(e)
    assert " --omp-num-threads 8" in script and "    critic.fsdp.offload_policy=True \\\n" in script
    assert "    +ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS='\"8\"' \\\n" in script
    path = tmp_path / "critic.sh"
    path.write_text(script.replace(" --omp-num-threads 8", ""))
    setup = read_rl_setup(path)
    assert (setup.knobs["omp_num_threads"], setup.knobs["critic_offload_policy"]) == (8, True)
    read = rl_estimate(setup.model, **setup.knobs)
    assert read.host.terms == e.host.terms and read.time == e.time
    path.write_text(script.replace("    critic.strategy=fsdp2 \\\n", ""))
    setup = read_rl_setup(path)
    assert (setup.knobs["critic_offload_policy"], setup.knobs["critic_strategy"]) == (True, "fsdp")
    read = rl_estimate(setup.model, **setup.knobs)
    plain = rl_estimate("qwen2.5-7b", 8, **dict(CRITIC_POLICY, critic_offload_policy=False, critic_strategy="fsdp"))
    assert not read.memory.critic.on_host and read.host.terms == plain.host.terms and read.time == plain.time
    assert any(n.startswith("critic.fsdp.offload_policy is ignored under critic.strategy fsdp") for n in read.notes)


def test_a_critic_left_at_verls_defaults_is_priced_as_verl_runs_it(tmp_path):
    """The PPO script as --emit verl writes it (an FSDP2 bf16 actor; the critic as priced, the actor's strategy and
    dtype: critic.strategy=fsdp2, critic.fsdp.model_dtype=bf16) read back prices the same critic; with both keys
    dropped verl runs its defaults, FSDP1 and fp32, and check prices those: the critic's 7,070,622,721 parameters
    and its value head's dim-0 padding (FSDP2 pads the 1 x 3,584 weight to 16 rows at d = 16, torch 2.13
    _fsdp_param.py padded_sharded_param_size: + 15 x 3,584 = 53,760, so 7,070,676,481) over 16 GPUs, 4 B each,
    1,767,669,121 B a GPU (not bf16's 883,834,561), Adam's 8 B, 3,535,338,241 (not 1,767,669,121); the actor's
    phases as before. (FSDP1 is priced with FSDP2's padding, cost_models/dim0_padding.py: its flat parameter pads
    a unit to a multiple of 16 elements, 3,360 parameters a GPU fewer.)"""
    e = rl_estimate("qwen2.5-7b", 16, **PPO)
    script = emit_verl(e)
    lines = ("    critic.strategy=fsdp2 \\\n", "    critic.fsdp.model_dtype=bf16 \\\n")
    assert all(line in script for line in lines)
    c = e.memory.critic
    assert (c.params_bytes, c.optimizer_bytes) == (883_834_561, 1_767_669_121)
    for line in lines:
        script = script.replace(line, "")
    (tmp_path / "ppo.sh").write_text(script)
    setup = read_rl_setup(tmp_path / "ppo.sh")
    assert (setup.knobs["critic_strategy"], setup.knobs["critic_dtype"]) == ("fsdp", "fp32")
    read = rl_estimate(setup.model, **setup.knobs)
    assert (read.memory.critic.params_bytes, read.memory.critic.optimizer_bytes) == (1_767_669_121, 3_535_338_241)
    assert read.memory.phases == rl_estimate("qwen2.5-7b", 16, critic_strategy="fsdp", critic_dtype="fp32",
                                             **PPO).memory.phases
    actor = ("log_prob", "ref_log_prob", "update")
    assert [p.gpu_bytes.get("actor params") for p in read.memory.phases if p.name in actor] == [
        p.gpu_bytes.get("actor params") for p in e.memory.phases if p.name in actor]


def test_load_format_is_read_and_priced(tmp_path):
    """rollout.load_format round-trips (--emit verl writes it, check reads it: equal figures). verl 0.9.1 starts a LoRA
    adapter's engine without the base under dummy (engine_workers.py:673 base_sync_done = "dummy" not in
    load_format), so its first sync sends the whole fp32 base from each rank's host: Qwen2-7B on 2 GPUs, 2 x 4 x
    7,615,616,512 = 60,924,932,096 B per node; a hand-written script with load_format=safetensors and no
    layered_summon (the 48f8ce1 case) is not charged it. layered_summon under dummy: verl raises at that first sync
    (collect_lora_params), a refusal naming load_format, exit 1; merged LoRA (model.lora.merge) never asks for the
    base apart: runs. A value verl's engines do not take: one line naming the key, exit 2."""
    lora = dict(CASE_1, finetune="lora")
    path = tmp_path / "lora.sh"
    for load_format, base in (("safetensors", 0), ("dummy", 2 * 4 * 7_615_616_512)):
        e = rl_estimate("qwen2-7b", 2, **dict(lora, load_format=load_format))
        path.write_text(emit_verl(e))
        setup = read_rl_setup(path)
        assert setup.knobs["load_format"] == load_format
        read = rl_estimate(setup.model, **setup.knobs)
        assert (read.host, read.memory.phases) == (e.host, e.memory.phases)
        assert sum(read.host.sync_terms.values()) == base
    assert base == 60_924_932_096
    layered = emit_verl(rl_estimate("qwen2-7b", 2, **dict(lora, layered_summon=True, load_format="safetensors")))
    line = "    actor_rollout_ref.rollout.load_format=safetensors \\\n"
    assert line in layered
    path.write_text(layered.replace(line, ""))   # verl's default, dummy
    r = run(path, "--format", "json")
    assert r.returncode == 1, r.stderr
    assert json.loads(r.stdout)["reasons"] == [
        "load_format: dummy under layered_summon: verl 0.9.1 raises at the first weight sync (collect_lora_params: "
        "the LoRA base must be preloaded in the engine); set --load-format safetensors (rollout.load_format), or drop "
        "--layered-summon"]
    path.write_text(layered.replace(line, "").replace("lora.merge=False", "lora.merge=True"))
    merged = read_rl_setup(path)
    assert merged.knobs["lora_merge"] is True and rl_estimate(merged.model, **merged.knobs).fits
    path.write_text(layered.replace(line, "    actor_rollout_ref.rollout.load_format=dummy_dtensor \\\n"))
    r = run(path)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: actor_rollout_ref.rollout.load_format: unknown value 'dummy_dtensor'; choose one of: dummy, auto, "
        "safetensors, pt")


REWARD = dict(gpu="h100-80gb", actor_dtype="bf16", prompt_len=1024, response_len=1024, train_batch=256,
              rollout_n=8, reward_model="qwen2.5-7b", reward_model_gpu_memory_utilization=0.3)
LEGACY_REWARD = """python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_batch_size=256 \\
    data.max_prompt_length=1024 data.max_response_length=1024 actor_rollout_ref.rollout.n=8 \\
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \\
    actor_rollout_ref.actor.fsdp_config.model_dtype=bf16 trainer.n_gpus_per_node=8 \\
    reward_model.enable=True reward_model.model.path=qwen2.5-7b reward_model.rollout.gpu_memory_utilization=0.3
"""


def test_a_reward_model_emitted_then_checked_prices_the_same(tmp_path):
    """--reward-model through verl's reward.reward_model.* keys and back: the `reward` phase and every other, the
    host RAM and the step time (its reward_s) equal."""
    e = rl_estimate("qwen2.5-7b", 8, **REWARD)
    assert e.memory.reward is not None and "reward" in {p.name for p in e.memory.phases}
    (tmp_path / "rm.sh").write_text(emit_verl(e))
    checked = json.loads(run_cli(["check", str(tmp_path / "rm.sh"), "--format", "json"]))
    same_memory(checked, e)
    assert checked["time"] == rl_dict(e)["time"] and checked["time"]["reward_s"] > 0


def test_the_legacy_reward_model_keys_read_as_verl_migrates_them(tmp_path):
    """reward_model.enable / model.path / rollout.* (what verl's migrate_legacy_reward_impl moves under reward.)
    price the reward model as the current keys do; enabled without a path is one line naming the key."""
    (tmp_path / "legacy.sh").write_text(LEGACY_REWARD)
    setup = read_rl_setup(str(tmp_path / "legacy.sh"))
    assert (setup.knobs["reward_model"], setup.knobs["reward_model_gpu_memory_utilization"]) == ("qwen2.5-7b", 0.3)
    (tmp_path / "nopath.sh").write_text(LEGACY_REWARD.replace(" reward_model.model.path=qwen2.5-7b", ""))
    r = run(tmp_path / "nopath.sh", "--model", "qwen2.5-7b")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: reward.reward_model.model_path: missing")


def test_a_reward_pool_emitted_then_checked_prices_the_same_and_its_gaps_are_said(tmp_path):
    """reward.reward_model.enable_resource_pool / n_gpus_per_node / nnodes written and read back: the actor's phases,
    the pool's GPU and the streamed time equal. Its legacy spelling reads alike. A pool left at verl's nnodes 0 is
    one line naming the key (verl raises too); free_cache_engine left at verl's true is said (the engine would
    sleep at start, never woken by the streaming path)."""
    e = rl_estimate("qwen2.5-7b", 8, **REWARD, reward_model_enable_resource_pool=True, reward_model_n_gpus_per_node=4)
    script = emit_verl(e)
    (tmp_path / "pool.sh").write_text(script)
    checked = json.loads(run_cli(["check", str(tmp_path / "pool.sh"), "--format", "json"]))
    same_memory(checked, e)
    assert (checked["time"], checked["reward_pool"]) == (rl_dict(e)["time"], rl_dict(e)["reward_pool"])
    assert checked["time"]["reward_overlapped_s"] > 0
    assert "reward" not in [p["name"] for p in checked["memory"]["phases"]]
    awake = "    reward.reward_model.rollout.free_cache_engine=False \\\n"
    (tmp_path / "legacy.sh").write_text(LEGACY_REWARD.rstrip() + " reward_model.enable_resource_pool=True "
                                        "reward_model.n_gpus_per_node=4 reward_model.nnodes=1\n")
    setup = read_rl_setup(str(tmp_path / "legacy.sh"))
    assert (setup.knobs["reward_model_enable_resource_pool"], setup.knobs["reward_model_n_gpus_per_node"],
            setup.knobs["reward_model_nnodes"]) == (True, 4, 1)
    assert any(n.startswith("reward.reward_model.rollout.free_cache_engine is true") for n in setup.notes)
    assert not any("free_cache_engine is true" in n for n in read_rl_setup(str(tmp_path / "pool.sh")).notes)
    (tmp_path / "nonodes.sh").write_text(script.replace(awake, "").replace("    reward.reward_model.nnodes=1 \\\n", ""))
    r = run(tmp_path / "nonodes.sh")
    assert r.returncode == 2 and r.stderr.strip() == "error: reward.reward_model.nnodes: must be > 0, got 0"


def test_a_sleep_level_verl_does_not_run_is_read_and_said(tmp_path):
    """verl has no key for the engine's sleep level: a `# fsdp-plan:` line asking for level 1 on a full model is
    read, priced at verl's level 2 (no host backup) and said in one note."""
    e = rl_estimate("qwen2.5-7b", 8, **REWARD)
    script = emit_verl(e).replace("# fsdp-plan: --model qwen2.5-7b", "# fsdp-plan: --model qwen2.5-7b --sleep-level 1")
    (tmp_path / "level.sh").write_text(script)
    checked = json.loads(run_cli(["check", str(tmp_path / "level.sh"), "--format", "json"]))
    same_memory(checked, e)
    assert not any("engine weight backup" in t for t in checked["memory"]["host"]["terms"])
    said = [n for n in checked["notes"] if n.startswith("--sleep-level 1 is not what verl runs")]
    assert len(said) == 1 and "priced at level 2" in said[0]


# TRL's vllm_mode server (cost_models/rl_trl_server.py): TP 2 on a node of its own, vllm serve's own batch knobs;
# and several generations per optimizer step (steps_per_generation 16 < gradient_accumulation_steps 40)
TRL_SERVER = dict(TRL_CASE_1, vllm_mode="server", vllm_server_host="10.0.0.2", gpu_memory_utilization=0.85,
                  max_num_seqs=512, max_num_batched_tokens=8192)
TRL_GENERATIONS = dict(TRL_CASE_1, train_batch=128, param_offload=False, optimizer_offload=False)


@pytest.mark.parametrize("knobs", [TRL_SERVER, TRL_GENERATIONS], ids=["trl-server", "trl-generations"])
def test_trl_server_and_generations_emitted_then_checked_price_the_same(tmp_path, knobs):
    """--emit trl writes vllm_mode server with the server's `trl vllm-serve` line as a comment, or a generation batch
    below the mini-batch (TRL's steps_per_generation 128 x 5 / 2 / 16 = 20 < 40); check reads them back: every
    phase, the engine and the step time equal."""
    e = rl_estimate("qwen2-7b", 2, **knobs)
    (tmp_path / "grpo.yaml").write_text(emit_trl(e))
    r = run(tmp_path / "grpo.yaml", "--format", "json")
    assert r.returncode == (0 if e.fits else 1), r.stderr
    checked = json.loads(r.stdout)
    same_memory(checked, e)
    assert checked["engine"] == rl_dict(e)["engine"] and checked["time"] == rl_dict(e)["time"]


def test_a_hand_written_server_config_reads_trls_keys_and_vllms_line(tmp_path):
    """A GRPOConfig of TRL's own keys: vllm_server_base_url's host (another node) over vllm_server_host, the server
    from a `vllm serve` line (its dashes or TRL's underscores), vllm serve's defaults where the line is missing
    (with a note); an optimizer step of part of a group is one line naming gradient_accumulation_steps."""
    grpo = ("use_vllm: true\nvllm_mode: server\nvllm_server_base_url: http://10.1.2.3:8000\nnum_generations: 8\n"
            "per_device_train_batch_size: 4\ngradient_accumulation_steps: 4\nsteps_per_generation: 2\n"
            "max_completion_length: 512\nvllm_max_model_length: 1024\n")
    path = tmp_path / "server.yaml"
    path.write_text("# VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen2.5-7B --tensor-parallel-size 2 "
                    "--data_parallel_size=1 --gpu-memory-utilization 0.8 --enforce-eager --max-num-seqs 64\n" + grpo)
    k = read_rl_setup(path, gpus=4).knobs
    assert (k["vllm_mode"], k["vllm_server_host"], k["rollout_tp"], k["vllm_server_data_parallel_size"],
            k["gpu_memory_utilization"], k["enforce_eager"], k["max_num_seqs"]) == ("server", "10.1.2.3", 2, 1, 0.8,
                                                                                   True, 64)
    assert (k["train_batch"], k["ppo_mini_batch_size"]) == (4, 8)   # 2 x 4 x 4 / 8 prompts a generation, 4 x ...
    path.write_text(grpo)
    setup = read_rl_setup(path, gpus=4)
    assert (setup.knobs["rollout_tp"], setup.knobs["gpu_memory_utilization"]) == (1, 0.9)
    assert any("no `trl vllm-serve` line" in n for n in setup.notes)
    path.write_text(grpo.replace("gradient_accumulation_steps: 4", "gradient_accumulation_steps: 1")
                    .replace("per_device_train_batch_size: 4", "per_device_train_batch_size: 2"))
    r = run(path, "--model", "qwen2.5-7b", "--gpus", "2")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: gradient_accumulation_steps: 1: an optimizer")
    assert len(r.stderr.strip().splitlines()) == 1


def test_verls_target_modules_list_prices_attention_only_lora(tmp_path):
    """Case 1's script made LoRA on Qwen3-30B-A3B served by SGLang (FSDP2, 8 GPUs) with model.target_modules the
    attention projections, as a Hydra list in a script and a YAML list (any order): priced as `rl estimate
    --lora-targets attention`, phase for phase - the actor's shard (30,532,122,624 + 48 x 557,056) x 4 / 8 =
    15,279,430,656 B (tests/unit/test_rl_lora_targets.py by hand) and SGLang's pool for qkv_proj and o_proj alone,
    every phase below all-linear's. A list that is not the attention projections, or a string (a regex to PEFT):
    one line naming the key, exit 2."""
    lora = VERL_EXAMPLE.replace("model_path=Qwen/Qwen2-7B-Instruct", "model_path=qwen3-30b-a3b").replace(
        "trainer.n_gpus_per_node=2", "trainer.n_gpus_per_node=8").replace("rollout.name=vllm", "rollout.name=sglang")
    lr = "    actor_rollout_ref.actor.optim.lr=1e-6 \\\n"
    lora = lora.replace(lr, lr + "    actor_rollout_ref.actor.strategy=fsdp2 \\\n"
                        "    actor_rollout_ref.model.lora_rank=32 \\\n"
                        "    actor_rollout_ref.model.target_modules=TARGETS \\\n")
    knobs = dict(CASE_1, gpu="h100-80gb", engine="sglang", engine_version="current", enforce_eager=False,
                 finetune="lora", strategy="fsdp2")
    for key in ("max_num_seqs", "mean_prompt_len", "mean_response_len"):
        knobs.pop(key)
    attention = rl_estimate("qwen3-30b-a3b", 8, **knobs, lora_targets="attention")
    all_linear = rl_estimate("qwen3-30b-a3b", 8, **knobs)
    assert attention.memory.actor.params_bytes == 15_279_430_656
    (tmp_path / "run.sh").write_text(lora.replace("TARGETS", "'[q_proj,k_proj,v_proj,o_proj]'"))
    checked = json.loads(run(tmp_path / "run.sh", "--gpu", "h100-80gb", "--format", "json").stdout)
    same_memory(checked, attention)
    assert all(a["reserved_bytes"] < b["reserved_bytes"] for a, b in zip(checked["memory"]["phases"],
                                                                        rl_dict(all_linear)["memory"]["phases"]))
    read = read_rl_setup(tmp_path / "run.sh")
    nested = {"actor_rollout_ref": {"model": {"lora_rank": 32, "target_modules": ["o_proj", "q_proj", "k_proj",
                                                                                "v_proj"]},
                                    "rollout": {"name": "sglang"}, "actor": {"ppo_micro_batch_size_per_gpu": 16}}}
    (tmp_path / "job.yaml").write_text(json.dumps(nested))   # JSON is YAML
    assert read.knobs["lora_targets"] == "q_proj,k_proj,v_proj,o_proj"
    assert read_rl_setup(tmp_path / "job.yaml").knobs["lora_targets"] == "o_proj,q_proj,k_proj,v_proj"
    for bad, said in (("[q_proj,v_proj]", "[q_proj,v_proj] is not priced; choose one of: all-linear, attention (the "
                                          "attention projections alone: [q_proj,k_proj,v_proj,o_proj] for "
                                          "qwen3-30b-a3b)"),
                      ("attention", "'attention' is a regex to PEFT, not priced; choose one of: all-linear, or the "
                                    "attention projections as a list, e.g. [q_proj,k_proj,v_proj,o_proj]")):
        (tmp_path / "bad.sh").write_text(lora.replace("TARGETS", bad))
        r = run(tmp_path / "bad.sh")
        assert (r.returncode, r.stderr) == (2, f"error: actor_rollout_ref.model.target_modules: {said}\n")


def test_trls_model_config_lora_keys_price_the_adapters(tmp_path):
    """TRL's GRPO script reads ModelConfig's keys from the same YAML as GRPOConfig's (trl/scripts/grpo.py's
    TrlParser; get_peft_config: LoraConfig(r=lora_r, target_modules=lora_target_modules) where use_peft): check
    prices LoRA at lora_r on those targets, phase for phase as the same file saying it on its `# fsdp-plan:` line;
    use_peft left out (ModelConfig's default false) is full fine-tuning, whose actor holds more."""
    from trl import ModelConfig

    peft = {"use_peft": True, "lora_r": 32, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    ModelConfig(**peft)   # TRL's own names and types
    grpo = ("use_vllm: true\nnum_generations: 8\nper_device_train_batch_size: 4\ngradient_accumulation_steps: 4\n"
            "max_completion_length: 512\nvllm_max_model_length: 1024\nmodel_init_kwargs:\n  dtype: bfloat16\n")
    model_keys = "use_peft: true\nlora_r: 32\nlora_target_modules: [q_proj, k_proj, v_proj, o_proj]\n"
    (tmp_path / "keys.yaml").write_text(grpo + model_keys)
    k = read_rl_setup(tmp_path / "keys.yaml", gpus=4).knobs
    assert (k["finetune"], k["lora_rank"], k["lora_targets"]) == ("lora", 32, "attention")
    (tmp_path / "line.yaml").write_text("# fsdp-plan: --finetune lora --lora-rank 32 --lora-targets attention\n" + grpo)
    (tmp_path / "full.yaml").write_text(grpo)
    checked = {name: json.loads(run(tmp_path / f"{name}.yaml", "--model", "qwen2.5-7b", "--gpus", "4",
                                    "--format", "json").stdout) for name in ("keys", "line", "full")}
    assert checked["keys"]["memory"] == checked["line"]["memory"]
    assert "finetune" not in read_rl_setup(tmp_path / "full.yaml", gpus=4).knobs
    assert checked["full"]["memory"]["peak_reserved_bytes"] > checked["keys"]["memory"]["peak_reserved_bytes"]
