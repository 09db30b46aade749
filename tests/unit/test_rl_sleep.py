"""The engine's sleep at the level the framework runs (cost_models/rl_sleep.py), not the one asked: verl 0.9.1 sleeps
vLLM at level 1 for a LoRA adapter (vllm_async_server._resolve_sleep_level) and at 2 otherwise; TRL at 2. Worked by
hand on Qwen2.5-7B (7,615,616,512 parameters) on 8 x H100 80GB, rollout TP 2: the engine's bf16 weights are
7,615,616,512 x 2 B / 2 = 7,615,616,512 B a GPU; host copies at 50 GB/s. A LoRA adapter's vLLM buffers sleep with
them (allocated under the same "weights" tag, cost_models/rollout_lora.py): 103,618,616 B a GPU at rank 32
(tests/unit/test_rollout_lora.py works them out)."""

import pytest

from cost_models.rl_settings import RlSettings
from cost_models.spec_values import SpecError
from planner.rl import rl_estimate

P7 = 7_615_616_512
LORA_TP2 = 103_618_616   # vLLM's LoRA buffers at TP 2, rank 32 (test_rollout_lora.py)
JOB = dict(gpu="h100-80gb")


@pytest.fixture(scope="module")
def runs():
    return {name: rl_estimate("qwen2.5-7b", 8, **JOB, **knobs) for name, knobs in {
        "full": {}, "full asks 1": dict(sleep_level=1), "lora": dict(finetune="lora"),
        "lora asks 2": dict(finetune="lora", sleep_level=2), "lora layered": dict(finetune="lora",
                                                                                 layered_summon=True,
                                                                                 load_format="safetensors")}.items()}


def test_host_backup_appears_exactly_when_level_1_runs(runs):
    """Level 1 backs the engine's weights and LoRA buffers up on the host (8 GPUs x (7,615,616,512 + 103,618,616) B
    = 61,753,881,024 B per node) and copies them out and back each step (2 x 7,719,235,128 B, 0.309 s at 50 GB/s:
    all a LoRA job's offload copies here, its reference being the actor); level 2 discards them: no term, and the
    full job's only copy is its bf16 reference shard streamed in (1,903,904,128 B)."""
    pool = P7 + LORA_TP2
    for name, e in runs.items():
        level = e.settings.sleep_level
        assert level == (1 if name.startswith("lora") else 2), name
        backup = {k: v for k, v in e.host.terms.items() if "backup" in k}
        assert backup == ({"engine weight backup (sleep level 1)": 8 * pool} if level == 1 else {}), name
        assert f"engine asleep (level {level})" in e.memory.phases[3].offloaded
        assert e.time.offload_s * 50e9 == pytest.approx(2 * pool if level == 1 else 1_903_904_128, rel=1e-12)
    assert 8 * P7 == 60_924_932_096 and 8 * pool == 61_753_881_024


def test_a_level_verl_does_not_run_is_one_note_and_priced_as_verl_runs(runs):
    """Asked for level 1 on a full model (or 2 on LoRA), the estimate is the one verl runs, with one note saying so;
    rollout.layered_summon does not move vLLM's level (it sets an attribute only SGLang's sync reads)."""
    for asked, runs_as in (("full asks 1", "full"), ("lora asks 2", "lora")):
        e, ref = runs[asked], runs[runs_as]
        assert (e.memory.phases, e.host, e.time) == (ref.memory.phases, ref.host, ref.time)
        extra = [n for n in e.notes if n not in ref.notes]
        said = f"--sleep-level {e.request.sleep_level} is not what verl runs: verl 0.9.1 sleeps the engine at level "
        assert len(extra) == 1 and extra[0].startswith(said + str(e.settings.sleep_level))
    assert not any("sleep-level" in n for n in runs["full"].notes + runs["lora"].notes)
    assert runs["lora layered"].settings.sleep_level == 1


def test_sglang_under_verl_keeps_a_lora_adapters_weights_and_backs_a_full_model_up():
    """SGLang (async_sglang_server.sleep): a LoRA adapter releases its KV cache only, so the engine's weights
    (7,615,616,512 B) stay on the GPU through every training phase and nothing is backed up; a full model's weights
    are released with enable_weights_cpu_backup: on the host (the level-2 term), copied out and back."""
    lora = rl_estimate("qwen2.5-7b", 8, **JOB, finetune="lora", engine="sglang")
    full = rl_estimate("qwen2.5-7b", 8, **JOB, engine="sglang")
    assert all(p.gpu_bytes["engine weights"] == P7 for p in lora.memory.phases)
    assert not any("backup" in k for k in lora.host.terms) and lora.time.offload_s == 0
    assert all("engine weights" not in p.gpu_bytes for p in full.memory.phases if p.name in ("update", "log_prob"))
    assert full.host.terms["engine weight backup (sleep level 2)"] == 8 * P7
    assert full.time.offload_s * 50e9 == pytest.approx(2 * P7 + 1_903_904_128, rel=1e-12)


def test_trl_sleeps_at_2_and_a_bad_level_is_one_line():
    assert RlSettings(framework="trl", sleep_level=None).sleep_level == 2
    assert RlSettings(finetune="lora").sleep_level == 1 and RlSettings().sleep_level == 2
    with pytest.raises(SpecError, match="sleep_level: must be 1 or 2, got 3"):
        RlSettings(sleep_level=3)
