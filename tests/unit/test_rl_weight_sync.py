"""verl 0.9.1's weight sync as its code runs it, worked by hand at Qwen2.5-7B (7,615,616,512 parameters; embedding =
head = 544,997,376; the largest linear the MLP's 18,944 x 3,584 = 67,895,296), an fp32 actor on 8 x H100:

- the bucketed sender's 2 GiB transfer buffer on the trainer's GPU (workers/rollout/vllm_rollout/
  bucketed_weight_transfer.py BucketedWeightSender._init_buffer, rollout.yaml update_weights_bucket_megabytes 2048);
- LoRA with model.lora.merge (workers/engine/fsdp/transformer_impl.py _merged_lora_per_tensor_param; utils/
  fsdp_utils.py merged_lora_context, fsdp_merge_unmerge): the merged weights sent, the engine without an adapter at
  level 2 (vllm_async_server.py lora_as_adapter), the base backed up to the host;
- LoRA as an adapter under rollout.load_format dummy: the first sync's whole base on every rank's host
  (engine_workers.py base_sync_done; utils/fsdp_utils.py collect_lora_params(base_sync_done=False)); none under
  another load_format, and layered_summon refused under dummy (collect_lora_params raises).
"""

import pytest

from cost_models.rl_strategy import SYNC_BUCKET_BYTES
from planner.rl import rl_estimate

N, EMB, MLP = 7_615_616_512, 544_997_376, 18_944 * 3_584
# rank-32 all-linear adapters: 28 blocks x 32 x (in + out) summed over q, k, v, o, gate, up, down = 90,112
ADAPTERS = 28 * 32 * (2 * 3_584 + 2 * (3_584 + 512) + 2 * 3_584 + 3 * (3_584 + 18_944))
SHARD = (N + ADAPTERS) * 4 // 8   # 3,848,178,432: the fp32 LoRA actor's shard on 8 GPUs
JOB = dict(gpu="h100-80gb", prompt_len=1024, response_len=1024, train_batch=64, rollout_n=8)


def _sync(e):
    return next(p for p in e.memory.phases if p.name == "weight_sync").gpu_bytes


@pytest.fixture(scope="module")
def lora():
    return {(s, m): rl_estimate("qwen2.5-7b", 8, finetune="lora", strategy=s, lora_merge=m, **JOB)
            for s in ("fsdp", "fsdp2") for m in (False, True)}


def test_the_senders_bucket_is_verls_2_gib_beside_the_send():
    """2048 << 20 = 2,147,483,648 B beside the gathered embedding (4 x 544,997,376); not under verl of 2025 (vLLM 0.8:
    tensors loaded in-process) nor TRL (its own sync)."""
    assert SYNC_BUCKET_BYTES == 2_147_483_648
    full = _sync(rl_estimate("qwen2.5-7b", 8, strategy="fsdp2", **JOB))
    assert (full["weight-transfer bucket"], full["gathered tensor"]) == (2_147_483_648, 4 * EMB)
    assert "weight-transfer bucket" not in _sync(rl_estimate("qwen2.5-7b", 8, engine_version="0.8", **JOB))
    assert "weight-transfer bucket" not in _sync(rl_estimate("qwen2.5-7b", 8, framework="trl", **JOB))


def test_merged_lora_sync_by_hand(lora):
    """FSDP1: the merge summons the whole model in fp32 (4 x 7,615,616,512 = 30,462,466,048 B) beside PEFT's two
    [18,944, 3,584] fp32 deltas (2 x 4 x 67,895,296 = 543,162,368) and the bucket (the merge runs inside the
    sender's generator), larger than the state-dict walk after it (copy 3,807,808,256 + 6,539,982,848). FSDP2: the
    merge on the shards; the send the embedding gathered in fp32 and its bf16 copy (.to(torch.bfloat16)):
    2,179,989,504 + 1,089,994,752, beside the bucket."""
    fsdp1, fsdp2 = _sync(lora["fsdp", True]), _sync(lora["fsdp2", True])
    assert (fsdp1["summoned params (merge)"], fsdp1["LoRA delta"]) == (30_462_466_048, 543_162_368)
    assert 4 * N == 30_462_466_048 and 2 * 4 * MLP == 543_162_368
    assert fsdp1["weight-transfer bucket"] == 2_147_483_648 and "summoned params" not in fsdp1
    assert (fsdp2["gathered tensor"], fsdp2["its bf16 copy"], fsdp2["weight-transfer bucket"]) == (
        4 * EMB, 2 * EMB, 2_147_483_648)
    # unmerged FSDP1 LoRA summons the model before update_weights (no bucket at that moment)
    assert _sync(lora["fsdp", False])["summoned params"] == 4 * N
    assert "weight-transfer bucket" not in _sync(lora["fsdp", False])


def test_merged_lora_serves_no_adapter_and_backs_the_base_up(lora):
    """Merged: level 2 (vllm_async_server.py lora_as_adapter is False), so no engine backup on the host; the merge's
    base backup instead, the shard of each of 8 GPUs: FSDP1 every flat parameter, (7,615,616,512 + 80,740,352
    adapter parameters) x 4 / 8 x 8 = 30,785,427,456 B; FSDP2 the base alone, 7,615,616,512 x 4 = 30,462,466,048
    (both as benchmarks/verl_sync_check.py measures verl's backup_base_model_weights on gloo). Time: FSDP1
    gathers the model twice (the merge's summon, then the state-dict walk), FSDP2 once, where FSDP2's adapter sync
    gathers the adapters alone (collect_lora_params: get_peft_model_state_dict's tensors, 80,740,352 x 4 / 8 =
    40,370,176 B a rank, over the 7 others at the bus's rate); the backup out and back over
    PCIe replaces the level-1 engine backup's (2 x (7,615,616,512 + 103,618,616) B: bf16 at TP 2 and the served
    adapter's vLLM buffers, cost_models/rollout_lora.py - none when merged: vLLM starts without enable_lora)."""
    assert ADAPTERS == 80_740_352 and 8 * SHARD == 30_785_427_456
    for s, backup in (("fsdp", 30_785_427_456), ("fsdp2", 4 * N)):
        merged, adapter = lora[s, True], lora[s, False]
        assert (merged.settings.sleep_level, adapter.settings.sleep_level) == (2, 1)
        assert not any(k.startswith("engine weight backup") for k in merged.host.terms)
        assert merged.host.sync_terms == {"LoRA merge's base backup (each sync)": backup}
        pcie = merged.cluster.gpu.pcie_bytes_per_s
        assert (merged.memory.engine.lora_bytes, adapter.memory.engine.lora_bytes) == (0, 103_618_616)
        assert merged.time.offload_s - adapter.time.offload_s == pytest.approx(
            (2 * backup / 8 - 2 * (N + 103_618_616)) / pcie, rel=1e-9)
    assert lora["fsdp", True].time.weight_sync_s == pytest.approx(2 * lora["fsdp", False].time.weight_sync_s)
    bus = lora["fsdp2", True].cluster.gpu.intra_node_bus_bytes_per_s
    assert lora["fsdp2", True].time.weight_sync_s == pytest.approx(SHARD * 7 / bus, rel=1e-9)
    assert lora["fsdp2", False].time.weight_sync_s == pytest.approx(40_370_176 * 7 / bus, rel=1e-9)
    assert ADAPTERS * 4 // 8 == 40_370_176


def test_the_first_lora_sync_holds_the_whole_base_on_every_ranks_host(lora):
    """Adapter mode under load_format dummy (verl's default): collect_lora_params(base_sync_done=False) keeps every
    parameter whole on the host, per rank: 8 x 4 x 7,615,616,512 = 243,699,728,384 B per node (bf16: half), beside
    what stays on the host (the engine's level-1 backup is woken into the GPU first); the node's peak. None under
    load_format safetensors / auto / pt (engine_workers.py:673 `base_sync_done = "dummy" not in load_format`: the
    engine loaded the base from disk) nor for a full actor; the GPU's phases are the same either way."""
    e = lora["fsdp2", False]
    assert e.host.sync_terms == {"LoRA base sent from the host (first sync)": 243_699_728_384}
    assert 8 * 4 * N == 243_699_728_384
    assert e.host.peak_bytes == e.host.process_bytes + 243_699_728_384
    bf16 = rl_estimate("qwen2.5-7b", 8, finetune="lora", actor_dtype="bf16", **JOB)
    assert sum(bf16.host.sync_terms.values()) == 8 * 2 * N
    full = rl_estimate("qwen2.5-7b", 8, **JOB)
    assert full.host.sync_terms == {} and full.host.sync_bytes == 0
    for load_format in ("safetensors", "auto", "pt"):
        disk = rl_estimate("qwen2.5-7b", 8, finetune="lora", strategy="fsdp2", load_format=load_format, **JOB)
        assert (disk.host.sync_terms, disk.host.sync_bytes) == ({}, 0)
        assert disk.host.peak_bytes == disk.host.process_bytes + max(
            disk.host.load_bytes, disk.host.resident_bytes + disk.host.checkpoint_staging_bytes) < e.host.peak_bytes
        assert disk.memory.phases == e.memory.phases and disk.fits == e.fits


def test_layered_summon_needs_the_base_preloaded():
    """collect_lora_params(layered_summon=True, base_sync_done=False) raises ("To use layered_summon, you must make
    sure base-model is preloaded in vllm", utils/fsdp_utils.py), FSDP1 and FSDP2 alike: under load_format dummy a
    refusal naming load_format; with safetensors it runs. A merged LoRA never syncs the base apart (engine_workers.py
    do_lora_base_sync only without model.lora.merge): not refused."""
    for strategy in ("fsdp", "fsdp2"):
        dummy = rl_estimate("qwen2.5-7b", 8, finetune="lora", strategy=strategy, layered_summon=True, **JOB)
        assert dummy.reasons == ("load_format: dummy under layered_summon: verl 0.9.1 raises at the first weight "
                                 "sync (collect_lora_params: the LoRA base must be preloaded in the engine); set "
                                 "--load-format safetensors (rollout.load_format), or drop --layered-summon",)
        disk = rl_estimate("qwen2.5-7b", 8, finetune="lora", strategy=strategy, layered_summon=True,
                           load_format="safetensors", **JOB)
        assert disk.fits and disk.host.sync_terms == {}
    merged = rl_estimate("qwen2.5-7b", 8, finetune="lora", lora_merge=True, layered_summon=True, **JOB)
    assert merged.fits


def test_a_reward_pool_puts_nothing_on_the_trainers_hosts():
    """RewardModelManager builds HFModelConfig(path=...) with use_shm False and vllm serve loads from disk: its own
    pool adds no host term on the trainer's nodes, and model.use_shm copies the actor's checkpoint only (2 x N B)."""
    base = rl_estimate("qwen2.5-7b", 8, use_shm=True, **JOB)
    pool = rl_estimate("qwen2.5-7b", 8, use_shm=True, reward_model="qwen2.5-7b", reward_model_enable_resource_pool=True,
                       **JOB)
    assert pool.host.terms == base.host.terms and base.host.terms["model copy in /dev/shm"] == 2 * N
    assert pool.host.process_bytes == base.host.process_bytes
