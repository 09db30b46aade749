"""SGLang's LoRA pool slots under verl (max_loras_per_batch, issue 28): `--max-loras-per-batch`, its verl key
(rollout.engine_kwargs.sglang.max_loras_per_batch, which verl 0.9.1's async_sglang_server.py launch_server merges
into SGLang's ServerArgs), written by --emit verl, read back by `fsdp-plan check`, the finding on a job left at
SGLang's 8 and the search's 1.

By hand (tests/unit/test_rollout_lora_sglang.py, the pool checked byte for byte against SGLang 0.5.23's own):
Qwen2.5-7B at TP 2, rank 32, 8 slots: 1,066,663,936 B a GPU, linear in the slots (every buffer's first dimension is
max_loras_per_batch: mem_pool.py get_lora_A_shape / get_lora_B_shape / the embedding's), so one slot is
1,066,663,936 / 8 = 133,332,992 B; with the csgmv backend's decode-graph rows at max_num_seqs 256 (4 x (6 x 256 + 2 +
2 x slots): 6,216 B at 8 slots, 6,160 at 1; tests/unit/test_rl_sglang_lora.py) 1,066,670,152 and 133,339,152 B, and
one slot frees 933,331,000 B."""

import dataclasses
import json

import pytest

from cost_models.rollout_lora_sglang import csgmv_graph_metadata_bytes
from planner.emit.verl import MAX_LORAS, emit_verl
from planner.rl import rl_estimate
from tests.doctor.cli_run import cli_process
from tests.doctor.test_rl_check import run, same_memory

POOL_8, SLOT, FREED = 1_066_670_152, 133_339_152, 933_331_000
META_8, META_1 = 6_216, 6_160   # the pool's graph rows at 8 slots and 1
# the job (docs/rl.md "SGLang's LoRA memory pool"): fp32 actor, rollout TP 2 at 0.5
JOB = dict(gpu="h100-80gb", prompt_len=1024, response_len=4096, rollout_n=8, train_batch=256, finetune="lora",
           engine="sglang")
LINE = f"+{MAX_LORAS}=1"   # the override as --emit verl writes it and the finding says it


@pytest.fixture(scope="module")
def left():
    return rl_estimate("qwen2.5-7b", 8, **JOB)


@pytest.fixture(scope="module")
def one():
    return rl_estimate("qwen2.5-7b", 8, **JOB, max_loras_per_batch=1)


def test_the_finding_says_the_bytes_one_slot_frees_and_the_override(left, one):
    """Left at SGLang's 8: the pool is 1,066,670,152 B and the finding gives 933,331,000 B freed with the exact
    override line; the KV tokens it names are what the estimate at one slot gains (SGLang pages one token: 32,552,
    here exactly). At one slot: the pool is one slot's 133,339,152 B, the KV cache holds the 933,331,000 B more
    (its tokens x bytes a token), and the finding is gone."""
    assert POOL_8 - SLOT == FREED and POOL_8 - META_8 == 8 * (SLOT - META_1)
    assert (left.memory.engine.lora_bytes, one.memory.engine.lora_bytes) == (POOL_8, SLOT)
    gained = one.memory.engine.kv_tokens - left.memory.engine.kv_tokens
    per_token = left.memory.engine.kv_bytes // left.memory.engine.kv_tokens
    assert gained == FREED // per_token == 32_552
    note = next(n for n in left.notes if n.startswith("SGLang's LoRA pool"))
    assert f"{FREED:,} B" in note and LINE in note and "--max-loras-per-batch 1" in note
    assert f"about {gained:,} tokens" in note and f"({POOL_8:,} B a GPU" in note
    assert not any(n.startswith("SGLang's LoRA pool") for n in one.notes)
    assert one.memory.engine.kv_bytes - left.memory.engine.kv_bytes == pytest.approx(FREED, abs=per_token)


def test_no_finding_where_sglang_serves_no_adapter():
    """Merged (model.lora.merge) or full fine-tuning: verl starts SGLang without enable_lora, no pool."""
    for knobs in (dict(JOB, lora_merge=True), dict(JOB, finetune="full")):
        e = rl_estimate("qwen2.5-7b", 8, **knobs)
        assert e.memory.engine.lora_bytes == 0 and not any("LoRA pool" in n for n in e.notes), knobs


def test_emitted_then_checked_prices_the_same(tmp_path, left, one):
    """--emit verl writes the override only where it differs from SGLang's 8; check reads it back (the `+` dropped,
    as Hydra's) and prices the same phases, byte for byte; a script without it prices SGLang's 8 and says so."""
    assert MAX_LORAS not in emit_verl(left) and MAX_LORAS not in emit_verl(rl_estimate(
        "qwen2.5-7b", 8, **JOB, max_loras_per_batch=8))
    script = emit_verl(one)
    assert f"    {LINE} \\" in script.splitlines()
    (tmp_path / "one.sh").write_text(script)
    r = run(tmp_path / "one.sh", "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    same_memory(out, one)
    assert out["knobs"]["max_loras_per_batch"] == 1
    assert not any("LoRA pool" in n for n in out["notes"])
    (tmp_path / "left.sh").write_text(emit_verl(left))
    out = json.loads(run(tmp_path / "left.sh", "--format", "json").stdout)
    same_memory(out, left)
    assert any(LINE in n for n in out["notes"])


def test_a_yaml_reads_the_nested_key(tmp_path, one):
    """verl's nested YAML form: engine_kwargs: {sglang: {max_loras_per_batch: 1}}."""
    from planner.doctor.readers import read_rl_setup

    (tmp_path / "job.yaml").write_text(
        "actor_rollout_ref:\n  model: {path: m, lora_rank: 32}\n  actor: {ppo_micro_batch_size_per_gpu: 4}\n"
        "  rollout: {name: sglang, engine_kwargs: {sglang: {max_loras_per_batch: 2}}}\n")
    assert read_rl_setup(tmp_path / "job.yaml").knobs["max_loras_per_batch"] == 2


def test_bad_values_are_one_line_exit_2(tmp_path, one):
    """The flag: 0 (SGLang asserts max_loras_per_batch > 0: arg_groups/lora_hook.py), or under vLLM (verl passes
    engine_kwargs.sglang to SGLang only). The script: a non-number or 0, named by verl's key. Under vLLM the
    script's key is ignored, as verl ignores it, and said."""
    argv = ["rl", "estimate", "--model", "qwen2.5-7b", "--gpus", "8", "--finetune", "lora"]
    for extra, said in ((["--engine", "sglang", "--max-loras-per-batch", "0"], "max_loras_per_batch: must be > 0"),
                        (["--max-loras-per-batch", "1"], "valid with --engine sglang only")):
        r = cli_process(argv + extra)
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    script = emit_verl(one)
    for value, said in (("abc", "'abc' is not a number"), ("0", "must be > 0")):
        (tmp_path / "bad.sh").write_text(script.replace(LINE, f"+{MAX_LORAS}={value}"))
        r = run(tmp_path / "bad.sh")
        assert r.returncode == 2 and r.stderr.startswith(f"error: {MAX_LORAS}: ") and said in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "vllm.sh").write_text(script.replace("rollout.name=sglang", "rollout.name=vllm"))
    out = json.loads(run(tmp_path / "vllm.sh", "--format", "json").stdout)
    assert any(n.startswith(f"{MAX_LORAS} is ignored") for n in out["notes"])
    assert out["engine"]["engine"] == "vllm"


def test_the_search_serves_the_adapter_from_one_slot():
    """`fsdp-plan rl` on the issue's job: the best (bf16, TP 4 at 0.6, merge off) runs one slot - its pool 1 / 8 of
    the 8 slots' at the same engine, its KV the difference more - and says why the slots are not searched;
    --max-loras-per-batch pins the request's."""
    from planner.rl.evaluate import evaluate_rl
    from planner.rl.request import rl_request
    from planner.rl.search import plan_rl

    best = plan_rl(rl_request("qwen2.5-7b", 8, **JOB), top=1).ranked[0]
    r = best.request
    assert (best.engine_settings.max_loras_per_batch, r.rollout_tp, r.lora_merge) == (1, 4, False)
    eight = evaluate_rl(dataclasses.replace(r, max_loras_per_batch=8))
    rows = [csgmv_graph_metadata_bytes(slots, best.engine_settings.max_num_seqs) for slots in (8, 1)]
    assert eight.memory.engine.lora_bytes - rows[0] == 8 * (best.memory.engine.lora_bytes - rows[1])
    assert best.memory.engine.kv_bytes - eight.memory.engine.kv_bytes == pytest.approx(
        eight.memory.engine.lora_bytes - best.memory.engine.lora_bytes,
        abs=best.memory.engine.kv_bytes // best.memory.engine.kv_tokens)
    assert best.time.generation_s <= eight.time.generation_s
    out = cli_process(["rl", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu", "h100-80gb", "--prompt-len", "1024",
                       "--response-len", "4096", "--finetune", "lora", "--engine", "sglang", "--format", "json",
                       "--top", "1", "--max-loras-per-batch", "8"])
    pinned = json.loads(out.stdout)
    assert pinned["not_searched"]["max_loras_per_batch"].startswith("the request's (8")
    assert pinned["candidates"][0]["knobs"]["max_loras_per_batch"] == 8
