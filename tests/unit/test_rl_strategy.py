"""verl's actor strategy (cost_models/rl_strategy.py): FSDP1's root flat parameter and state-dict copy against FSDP2's
separate embedding and head units, worked by hand from Qwen2.5-7B's config (embedding = head = 544,997,376
parameters, final norm 3,584, a block 233,057,792, 28 blocks; 7,615,616,512 in all), and the claim the search rests
on (planner/rl/search.py prunes FSDP1's choices by FSDP2's): FSDP2 never holds more, phase by phase (but the update
on a one-rank shard group), the engine and host RAM alike; its update differs from FSDP1's by the copies around the
collectives (cost_models/fsdp_copies.py), which favour either API by precision and finetune."""

import pytest

from cost_models.memory_types import MemoryBreakdown
from cost_models.rl_settings import RlSettings
from cost_models.rl_strategy import fsdp2_backward, separate_head_units
from planner.models import resolve_model
from planner.rl import rl_estimate

EMB, NORM, BLOCK = 544_997_376, 3_584, 233_057_792
ROOT = 2 * EMB + NORM   # 1,089,998,336


@pytest.fixture(scope="module")
def by_strategy():
    return {s: rl_estimate("qwen2.5-7b", 8, gpu="h100-80gb", strategy=s) for s in ("fsdp", "fsdp2")}


def test_weight_sync_by_hand(by_strategy):
    """The fp32 actor on 8 GPUs (a 3,807,808,256 B shard). FSDP1's SHARDED_STATE_DICT keeps a copy of the shard and
    walks the units with the root unsharded: root 4 x 1,089,998,336 + the embedding's full clone 4 x 544,997,376 =
    6,539,982,848 B (beside the engine's weights, which verl 0.9.1 wakes first); FSDP2 gathers one tensor at a time:
    the embedding, 2,179,989,504 B. TRL's FSDP1 summons one unit at a time, no copy: the root, 4,359,993,344 B."""
    fsdp1, fsdp2 = (by_strategy[s].memory.phases[2].gpu_bytes for s in ("fsdp", "fsdp2"))
    assert (fsdp1["state-dict shard copy"], fsdp1["gathered units"]) == (3_807_808_256, 6_539_982_848)
    assert ROOT * 4 + EMB * 4 == 6_539_982_848
    assert fsdp2["gathered tensor"] == 2_179_989_504 and "state-dict shard copy" not in fsdp2
    assert fsdp1["engine weights"] == fsdp2["engine weights"] == 7_615_616_512
    trl = next(p for p in rl_estimate("qwen2.5-7b", 8, gpu="h100-80gb", framework="trl").memory.phases
               if p.name == "weight_sync").gpu_bytes
    assert trl["gathered units"] == ROOT * 4 == 4_359_993_344 and "state-dict shard copy" not in trl


def test_forward_and_loss_hold_the_root_as_each_wraps_it(by_strategy):
    """Forward only (log-probs): FSDP1 the root and two blocks, (1,089,998,336 + 2 x 233,057,792) x 2 B =
    3,112,227,840; FSDP2 the norm and the largest of embedding + a block, two blocks, the head: (3,584 + 778,055,168)
    x 2 = 1,556,117,504. At the update's loss (the entropy's backward): FSDP1 the root, 2,179,996,672; FSDP2 the norm,
    7,168 (the embedding and the head resharded after their forward, as verl's own FSDP2 update holds them on gloo:
    tests/distributed/test_torchrun_verl_actor.py).
    accelerate's FSDP2 (TRL) wraps the layers only: FSDP1's root."""
    fsdp1, fsdp2 = by_strategy["fsdp"], by_strategy["fsdp2"]
    assert [e.memory.phases[3].gpu_bytes["gathered units"] for e in (fsdp1, fsdp2)] == [3_112_227_840, 1_556_117_504]
    assert [e.memory.actor.update_steady.unsharded_params for e in (fsdp1, fsdp2)] == [2_179_996_672, 7_168]
    trl = rl_estimate("qwen2.5-7b", 8, gpu="h100-80gb", framework="trl", strategy="fsdp2")
    assert next(p for p in trl.memory.phases if p.name == "log_prob").gpu_bytes["gathered units"] == 3_112_227_840


def test_fsdp2_backward_moments_by_hand():
    """The ledger's block moment holds the root gathered and the head's unsharded gradient (FSDP1's layout); FSDP2
    holds neither: 2 x (544,997,376 + 544,997,376) B of params and 2 x 544,997,376 of gradient fewer. During the last
    block's backward the head's fp32 reduce-scatter input (4 x 544,997,376) is in flight; at the loss only the
    embedding is resharded; LoRA leaves the head frozen; tied embeddings keep one root unit."""
    model = resolve_model("qwen2.5-7b")
    body = MemoryBreakdown(unsharded_params=2_646_112_256, unsharded_grads=1_225_792_512, collective_buffers=10)
    full, lora = RlSettings(strategy="fsdp2"), RlSettings(strategy="fsdp2", finetune="lora")
    mid = fsdp2_backward(body, "backward of block 26 (recomputed)", model, full, 2, 4, 8)
    assert (mid.unsharded_params, mid.unsharded_grads, mid.collective_buffers) == (
        2_646_112_256 - 2_179_989_504, 1_225_792_512 - 1_089_994_752, 10)
    last = fsdp2_backward(body, "backward of block 27", model, full, 2, 4, 8)
    assert last.collective_buffers == 10 + 2_179_989_504 and last.unsharded_grads == mid.unsharded_grads
    assert fsdp2_backward(body, "backward of block 27", model, lora, 2, 4, 8).collective_buffers == 10
    assert fsdp2_backward(body, "loss backward", model, full, 2, 4, 8).unsharded_params == 2_646_112_256 - 1_089_994_752
    assert fsdp2_backward(body, "optimizer step", model, full, 2, 4, 8) == body
    assert fsdp2_backward(body, "backward of block 27", model, RlSettings(strategy="fsdp"), 2, 4, 8) == body
    tied = resolve_model("llama3.2-1b")
    assert tied.tied_embeddings and fsdp2_backward(body, "backward of block 3", tied, full, 2, 4, 8) == body


@pytest.mark.parametrize("model, gpus, knobs", [
    ("qwen2.5-7b", 8, dict(param_offload=True, engine_version="0.8")),
    ("qwen2.5-7b", 8, dict(actor_dtype="bf16", entropy=False, ppo_micro_batch_size_per_gpu=8)),  # a block's peak
    ("qwen2.5-7b", 2, dict(finetune="lora", use_dynamic_bsz=True, ulysses_sequence_parallel_size=2)),
    ("qwen2.5-7b", 8, dict(framework="trl")),   # beta 0: TRL's FSDP2 reference (one unit) is not there
    ("qwen3-8b", 8, dict(fsdp_size=1, engine="sglang")),
    ("llama3.2-1b", 4, dict(gradient_checkpointing=False, ppo_micro_batch_size_per_gpu=1)),   # tied embeddings
], ids=["fp32-offload-vllm08", "bf16-block-peak", "lora-dynamic-ulysses", "trl", "fsdp-size-1", "tied"])
def test_fsdp2_holds_no_more_but_at_no_shard_and_only_the_trainer_passes_differ_in_time(model, gpus, knobs):
    job = dict(gpu="h100-80gb", prompt_len=1024, response_len=4096, rollout_n=8, train_batch=64, **knobs)
    fsdp1, fsdp2 = (rl_estimate(model, gpus, strategy=s, **job) for s in ("fsdp", "fsdp2"))
    assert [p.name for p in fsdp1.memory.phases] == [p.name for p in fsdp2.memory.phases]
    sharded = knobs.get("fsdp_size", -1) != 1  # fsdp_size 1: each GPU holds the actor, nothing gathered
    # except fsdp_size 1's update: FSDP1 runs NO_SHARD there and frees the root's bf16 copy after forward
    # (rl_strategy.loss_root_bytes), FSDP2 keeps its root's own (the final norm) gathered: FSDP1 holds that much less
    assert all(b.reserved_bytes <= a.reserved_bytes for a, b in zip(fsdp1.memory.phases, fsdp2.memory.phases)
               if sharded or a.name != "update")
    if not sharded:
        one, two = fsdp1.memory.actor.update_steady, fsdp2.memory.actor.update_steady
        assert one.unsharded_params == 0 and two.total_bytes - one.total_bytes == two.unsharded_params > 0
    assert (fsdp1.host.peak_bytes, fsdp1.memory.engine) == (fsdp2.host.peak_bytes, fsdp2.memory.engine)
    same = ("generation_s", "offload_s", "reward_s")
    assert [getattr(fsdp1.time, f) for f in same] == [getattr(fsdp2.time, f) for f in same]
    # the weight sync: FSDP1's LoRA summons the whole model, FSDP2's adapter sync gathers the adapters alone
    # (rl_time.synced_bytes); the search's pruning needs FSDP1's no faster (search._engine_side_as_fsdp2)
    lora = knobs.get("finetune") == "lora" and sharded
    assert (fsdp1.time.weight_sync_s > fsdp2.time.weight_sync_s if lora else
            fsdp1.time.weight_sync_s == fsdp2.time.weight_sync_s)
    assert (fsdp1.time.update_s != fsdp2.time.update_s) == sharded


def test_the_faster_api_follows_the_copies():
    """Qwen2.5-7B on 8 x H100 (d = 8). The fp32 actor (bf16 compute, fp32 reduction): FSDP1 casts its flat bf16
    gradient to fp32 and divides it whole before the reduce-scatter, FSDP2 packs it once in fp32: FSDP2's update
    is faster. The bf16 actor: FSDP1 copies nothing around its all-gathers, FSDP2 copies each in and out: FSDP1's is.
    LoRA (the base frozen in bf16): FSDP2 still copies the base out of every all-gather, FSDP1 reduces only the
    adapters' units: FSDP1's is."""
    job = dict(gpu="h100-80gb", prompt_len=1024, response_len=4096, rollout_n=8, train_batch=64)
    update = {(dtype, finetune, s): rl_estimate("qwen2.5-7b", 8, strategy=s, actor_dtype=dtype, finetune=finetune,
                                                **job).time.update_s
              for dtype, finetune in (("fp32", "full"), ("bf16", "full"), ("fp32", "lora")) for s in ("fsdp", "fsdp2")}
    assert update["fp32", "full", "fsdp2"] < update["fp32", "full", "fsdp"]
    assert update["bf16", "full", "fsdp"] < update["bf16", "full", "fsdp2"]
    assert update["fp32", "lora", "fsdp"] < update["fp32", "lora", "fsdp2"]


def test_verl_wraps_the_embedding_and_head_apart_when_untied():
    """verl 0.9.1's own _select_fsdp2_wrap_targets (utils/fsdp_utils.py, compiled out of its file: importing verl
    runs verl/__init__.py, which needs ray) on a 2-layer Qwen2 built on the meta device: the layers, embed_tokens and
    lm_head untied; the layers alone tied. What separate_head_units says for Qwen2.5-7B (untied) and Llama 3.2 1B."""
    from tests.unit.installed_source import function_from

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    select = function_from("verl", "utils/fsdp_utils.py", "_select_fsdp2_wrap_targets", {"nn": torch.nn})

    def wrapped(tied: bool) -> set:
        config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                          tie_word_embeddings=tied)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        targets = select(model, model._no_split_modules)
        return {name for name, module in model.named_modules() if any(module is t for t in targets)}

    layers = {"model.layers.0", "model.layers.1"}
    assert wrapped(tied=False) == layers | {"model.embed_tokens", "lm_head"} and wrapped(tied=True) == layers
    fsdp2 = RlSettings(strategy="fsdp2")
    assert separate_head_units(resolve_model("qwen2.5-7b"), fsdp2)
    assert not separate_head_units(resolve_model("llama3.2-1b"), fsdp2)


def test_fsdp1_state_dict_copies_the_shard_fsdp2_does_not():
    """The weight sync's state_dict() as verl sets it up (FSDP1: SHARDED_STATE_DICT with a device mesh, so DTensor
    values; FSDP2: fully_shard's DTensors), on a 2-layer Qwen2 in a fake 2-rank world on CPU (calibration/
    fake_world.py): FSDP1's values are new storages holding exactly the rank's shard, the copy rl_strategy prices
    (107,072 parameters x 4 B / 2 ranks = 214,144 B); FSDP2's are its sharded parameters themselves."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardedStateDictConfig, \
        StateDictType, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from calibration.fake_world import _FakeWorld

    def qwen2():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, tie_word_embeddings=False))

    def storages(tensors) -> list:
        return [t.to_local().untyped_storage() if hasattr(t, "to_local") else t.untyped_storage() for t in tensors]

    with _FakeWorld(2):
        mesh = init_device_mesh("cpu", (2,))
        model = qwen2()
        fsdp1 = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
                                         device_mesh=mesh, device_id=torch.device("cpu"), use_orig_params=False,
                                         mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                                        reduce_dtype=torch.float32))
        FullyShardedDataParallel.set_state_dict_type(fsdp1, StateDictType.SHARDED_STATE_DICT,
                                                     ShardedStateDictConfig())
        params = {s.data_ptr() for s in storages(fsdp1.parameters())}
        shard_bytes = sum(s.nbytes() for s in storages(fsdp1.parameters()))
        held = storages(fsdp1.state_dict().values())
        assert not any(s.data_ptr() in params for s in held) and sum(s.nbytes() for s in held) == shard_bytes
        assert shard_bytes == 214_144
        model = qwen2()
        for unit in (*model.model.layers, model.model.embed_tokens, model.lm_head, model):
            fully_shard(unit, mesh=mesh)
        params = {s.data_ptr() for s in storages(model.parameters())}
        assert all(s.data_ptr() in params for s in storages(model.state_dict().values()))
