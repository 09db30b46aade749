"""Print the JSON and text of a fixed set of verl RL estimates and one search (`fsdp-plan rl estimate` / `fsdp-plan
rl`), to check a change leaves verl's figures byte for byte: run it at two revisions and compare.

    .venv/bin/python benchmarks/rl_snapshot.py > after.txt     # then at the other revision: before.txt; cmp

The cases reach each verl rule: the default job, FSDP2 bf16, golden case 1 (offloads, vLLM 0.8), PPO (critic, LoRA,
dynamic batches, Ulysses, SGLang, 2 nodes), CPUOffloadPolicy, a reward model, fsdp_size 1 with LoRA."""

import json

from planner.rl import rl_estimate
from planner.rl.report import rl_dict, rl_plan_json, rl_text
from planner.rl.request import rl_request
from planner.rl.search import plan_rl

CASES = [
    ("qwen2.5-7b", 8, dict(gpu="h100-80gb")),
    ("qwen2.5-7b", 8, dict(gpu="h100-80gb", strategy="fsdp2", actor_dtype="bf16")),
    ("qwen2-7b", 2, dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, mean_prompt_len=100,
                         mean_response_len=300, train_batch=1024, ppo_mini_batch_size=256,
                         ppo_micro_batch_size_per_gpu=16, rollout_n=5, param_offload=True, optimizer_offload=True,
                         rollout_tp=2, gpu_memory_utilization=0.6, engine_version="0.8", enforce_eager=True,
                         max_num_seqs=1024)),
    ("qwen2.5-7b", 16, dict(gpu="h100-80gb", gpus_per_node=8, prompt_len=1024, response_len=2048, train_batch=256,
                            rollout_n=4, algorithm="ppo", strategy="fsdp2", actor_dtype="bf16", finetune="lora",
                            lora_rank=64, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=16384,
                            ulysses_sequence_parallel_size=2, critic_param_offload=True, engine="sglang",
                            cpu_ram_per_node="1TiB")),
    ("qwen2.5-7b", 8, dict(gpu="h100-80gb", strategy="fsdp2", actor_dtype="bf16", offload_policy=True)),
    ("qwen2.5-7b", 8, dict(gpu="h100-80gb", reward_model="qwen2.5-7b")),
    ("qwen3-8b", 8, dict(gpu="h100-80gb", fsdp_size=1, engine="sglang", finetune="lora")),
]

if __name__ == "__main__":
    for model, gpus, knobs in CASES:
        e = rl_estimate(model, gpus, **knobs)
        print(json.dumps(rl_dict(e), indent=1, sort_keys=True))
        print(rl_text(e))
    print(rl_plan_json(plan_rl(rl_request("qwen2.5-7b", 8, gpu="h100-80gb", prompt_len=1024, response_len=4096,
                                          rollout_n=8, train_batch=256), top=3)))
