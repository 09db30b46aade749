"""verl 0.9.1's weight sync as its code runs it, worked by hand at Qwen2.5-7B (7,615,616,512 parameters; embedding =
head = 544,997,376), an fp32 actor on 8 x H100:

- the bucketed sender's 2 GiB transfer buffer on the trainer's GPU (workers/rollout/vllm_rollout/
  bucketed_weight_transfer.py BucketedWeightSender._init_buffer, rollout.yaml update_weights_bucket_megabytes 2048);
- LoRA as an adapter under rollout.load_format dummy: the first sync's whole base on every rank's host
  (engine_workers.py base_sync_done; utils/fsdp_utils.py collect_lora_params(base_sync_done=False)).
"""

from cost_models.rl_strategy import SYNC_BUCKET_BYTES
from planner.rl import rl_estimate

N, EMB = 7_615_616_512, 544_997_376
JOB = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=64, rollout_n=8)


def _sync(e):
    return next(p for p in e.memory.phases if p.name == "weight_sync").gpu_bytes


def test_the_senders_bucket_is_verls_2_gib_beside_the_send():
    """2048 << 20 = 2,147,483,648 B beside the gathered embedding (4 x 544,997,376); not under verl of 2025 (vLLM 0.8:
    tensors loaded in-process) nor TRL (its own sync)."""
    assert SYNC_BUCKET_BYTES == 2_147_483_648
    full = _sync(rl_estimate("qwen2.5-7b", 8, strategy="fsdp2", **JOB))
    assert (full["weight-transfer bucket"], full["gathered tensor"]) == (2_147_483_648, 4 * EMB)
    assert "weight-transfer bucket" not in _sync(rl_estimate("qwen2.5-7b", 8, engine_version="0.8", **JOB))
    assert "weight-transfer bucket" not in _sync(rl_estimate("qwen2.5-7b", 8, framework="trl", **JOB))


def test_the_first_lora_sync_holds_the_whole_base_on_every_ranks_host():
    """Adapter mode under load_format dummy: collect_lora_params(base_sync_done=False) keeps every parameter whole on
    the host, per rank: 8 x 4 x 7,615,616,512 = 243,699,728,384 B per node (bf16: half), beside what stays on the
    host (the engine's level-1 backup is woken into the GPU first); the node's peak. None with layered_summon (the
    engine loads the base from disk: load_format safetensors) nor for a full actor."""
    e = rl_estimate("qwen2.5-7b", 8, finetune="lora", strategy="fsdp2", **JOB)
    assert e.host.sync_terms == {"LoRA base sent from the host (first sync)": 243_699_728_384}
    assert 8 * 4 * N == 243_699_728_384
    assert e.host.peak_bytes == e.host.process_bytes + 243_699_728_384
    bf16 = rl_estimate("qwen2.5-7b", 8, finetune="lora", actor_dtype="bf16", **JOB)
    assert sum(bf16.host.sync_terms.values()) == 8 * 2 * N
    layered = rl_estimate("qwen2.5-7b", 8, finetune="lora", layered_summon=True, **JOB)
    full = rl_estimate("qwen2.5-7b", 8, **JOB)
    assert layered.host.sync_terms == full.host.sync_terms == {} and full.host.sync_bytes == 0
