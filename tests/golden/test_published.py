"""Golden tests: the cost model against published FSDP measurements (shared/reference/published.md).

torchtitan, FSDP2 on 64 x A100 80GB (docs/performance.md, mid-2024): bf16 mixed precision with fp32
reduce, SDPA, no torch.compile. torchtitan's Llama uses its fused RMSNorm kernel (norm_type
"fused_rmsnorm" in its Llama training configs of that time), which saves only the norm's input, unlike the
eager Hugging Face RMSNorm our presets model; the specs below say so. The OOM row must be rejected and
the full-checkpointing 70B rows must fit.

Every published torchtitan row - A100, H100 (FSDP, + compile, + Float8; 8 and 128 GPUs; 32k context) and
H200 - is priced by the same defaults (cost_models/profile.py: one bf16 matmul efficiency and one
memory-bound efficiency, least squares over all sixteen rows jointly by `python
benchmarks/throughput_accuracy.py --fit`; the GPUs' own kernel figures from the catalog), each within the
10% issue 10 asks for (max 6.2%), and every published memory figure (H100, H200) within 10% (max 6.1%).

The mesh rows (issue 17) with the same defaults, nothing refitted: FSDP 8 x TP 8 on 64 H100 96GB (compile,
selective op-level checkpointing, local batch 12 per data-parallel rank = micro-batch 12 on each TP group;
bf16 and Float8 tensorwise, vanilla and async TP): -5.7%, +0.2%, -6.6%, -5.7%; FSDP 4 x CP 2 on 8 GPUs at
65,536 tokens (compile + Float8, full checkpointing): -3.6%, memory 81.5 vs 84.2 GiB (-3.2%). The Float8
rowwise TP rows are not priced (no rowwise recipe).
"""

from dataclasses import replace

import pytest

from planner import estimate
from planner.models import load_preset

TOLERANCE = 0.10  # tokens/s, every published row (see the module docstring)
MEMORY_TOLERANCE = 0.10  # peak reserved GiB, every row that publishes it

# model, local batch, seq, checkpointing, tokens/s/GPU, MFU (None: OOM in the published run)
ROWS = [
    ("llama2-13b", 2, 4096, "none", 2162, 0.611),
    ("llama2-13b", 2, 4096, "every-2", 1914, 0.541),
    ("llama2-70b", 2, 4096, "full", 353, 0.505),
    ("llama3-8b", 1, 8192, "every-2", 2876, 0.563),
    ("llama3-70b", 1, 8192, "full", 323, 0.505),
]


def torchtitan_llama(name):
    return replace(load_preset(name), norm="fused_rmsnorm", name=f"{name} (torchtitan)")


def _estimate(name, batch, seq, ac):
    return estimate(torchtitan_llama(name), gpus=64, gpu="a100-80gb", seq_len=seq, micro_batch=batch,
                    activation_checkpointing=ac, sharding="FULL_SHARD", precision="bf16")


@pytest.mark.parametrize("name,batch,seq,ac,tps,mfu", ROWS)
def test_torchtitan_throughput_and_mfu(name, batch, seq, ac, tps, mfu):
    c = _estimate(name, batch, seq, ac)
    assert c.fits, c.reasons
    assert c.time.tokens_per_s_per_gpu == pytest.approx(tps, rel=TOLERANCE)
    assert c.time.mfu == pytest.approx(mfu, rel=TOLERANCE)


def test_torchtitan_oom_row_is_rejected():
    # Llama 2 70B, local batch 2, seq 4096, selective (every other layer) checkpointing: OOM on 80 GB.
    c = _estimate("llama2-70b", 2, 4096, "every-2")
    assert not c.fits
    assert "GiB per GPU" in c.reasons[0]


def test_fsdp_paper_ddp_limit():
    # FSDP paper: DDP (NO_SHARD) and FSDP both train 611M and 2.28B models on 80 GB A100s; DDP runs out
    # of memory at the next size they tried (11.3B). Presets bracketing those: GPT-3 1.3B fits NO_SHARD,
    # GPT-3 6.7B does not (its fp32 Adam states alone are 6.7B x 16 B = 107 GB), but fits FULL_SHARD.
    kw = dict(gpus=8, gpu="a100-80gb", seq_len=2048, micro_batch=1)
    assert estimate("gpt-1.3b", sharding="NO_SHARD", **kw).fits
    big = estimate("gpt-6.7b", sharding="NO_SHARD", **kw)
    assert not big.fits and big.memory.peak_allocated_bytes > 107e9
    assert estimate("gpt-6.7b", sharding="FULL_SHARD", **kw).fits


def test_fsdp_paper_gpt175b_tflops_per_gpu():
    # FSDP paper: GPT-175B on 128-512 A100 80GB reaches > 173 TFLOP/s per GPU at batch 1 and > 186 at
    # batch 2 (about 55-60% of 312), with activation checkpointing; we read those as executed (hardware)
    # FLOPs, recompute included. The model must land in that band within 10%, on 2 Tb/s RoCE per host.
    for gpus, batch in ((128, 1), (512, 2)):
        c = estimate("gpt-175b", gpus=gpus, gpu="a100-80gb", seq_len=2048, micro_batch=batch,
                     activation_checkpointing="full", internode_gbps=2000)
        assert c.fits, c.reasons
        achieved = c.time.hfu * 312
        assert 0.9 * 173 <= achieved <= 1.1 * 200, achieved


def test_fsdp_paper_backward_prefetch_gain():
    # FSDP paper: backward prefetch made GPT-175B about 18% faster. The model's gain at 128 GPUs, batch 1,
    # on 2 Tb/s hosts must be a real speed-up of the same order: between 5% and 30%. The paper's FSDP is FSDP1
    # (FSDP2 always prefetches: the switch is FSDP1's).
    kw = dict(gpus=128, gpu="a100-80gb", seq_len=2048, micro_batch=1, activation_checkpointing="full",
              internode_gbps=2000, trainer="fsdp1")
    on = estimate("gpt-175b", **kw).time.tokens_per_s_per_gpu
    off = estimate("gpt-175b", backward_prefetch=False, **kw).time.tokens_per_s_per_gpu
    assert 1.05 <= on / off <= 1.30, on / off


def test_cpu_offload_slowdown():
    # published.md (PyTorch issue 74588): CPU offload with torch.optim.Adam gave 3-10x slower steps, the
    # CPU optimizer step the bottleneck. Llama 2 7B on 8 A100s at micro-batch 1 fits both ways.
    kw = dict(gpus=8, gpu="a100-80gb", seq_len=2048, micro_batch=1, activation_checkpointing="full")
    off = estimate("llama2-7b", **kw)
    on = estimate("llama2-7b", offload=True, **kw)
    assert off.fits and on.fits
    assert 3 <= on.time.step_s / off.time.step_s <= 10
    assert on.time.optimizer_s > on.time.offload_copy_s  # the CPU optimizer step dominates


def _benchmark_rows():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import throughput_accuracy

    return throughput_accuracy


BENCH = _benchmark_rows()
NEWER_ROWS = [r for r in BENCH.ROWS if r.gpu != "a100-80gb"]


@pytest.mark.parametrize("row", NEWER_ROWS, ids=lambda r: f"{r.gpus}x{r.gpu}-{r.micro_batch}x{r.seq_len}-"
                                                           + "+".join((r.checkpointing,) + r.options))
def test_h100_h200_rows_throughput(row):
    # torchtitan on H100 (Dec 2024: 96 GB HBM2e, 500 W) and H200 (Jun 2025), published.md: selective
    # op-level checkpointing, torch.compile, Float8 linears, FP8 all-gather, as each row ran them.
    c = BENCH.predict(row)
    assert c.fits, c.reasons
    assert c.time.tokens_per_s_per_gpu == pytest.approx(row.tokens_per_s, rel=TOLERANCE)


@pytest.mark.parametrize("row", [r for r in NEWER_ROWS if r.memory_gib is not None],
                         ids=lambda r: f"{r.gpus}x{r.gpu}-{r.seq_len}-" + "+".join((r.checkpointing,) + r.options))
def test_h100_h200_rows_memory(row):
    # torchtitan's reported peak (reserved) memory. The loss sets it: eager, three fp32 logits-sized
    # tensors at its backward plus the caching allocator's stranded bf16 segment (cost_models/allocator.py);
    # compiled (the H200 run: torchtitan compiles the loss since 2025), the bf16 logits and their gradient.
    c = BENCH.predict(row)
    # published: torch.cuda.max_memory_reserved, the caching allocator's alone (no CUDA context, no NCCL buffers)
    assert c.memory.allocator_reserved_bytes / 2**30 == pytest.approx(row.memory_gib, rel=MEMORY_TOLERANCE)


def test_optimizations_rank_as_published():
    # The published order on 8 x H100: FSDP < + compile < + compile + Float8, each a real gain.
    rows = [r for r in NEWER_ROWS if r.gpus == 8 and r.seq_len == 8192]
    tps = [BENCH.predict(r).time.tokens_per_s_per_gpu for r in rows]
    assert tps[0] * 1.03 < tps[1] and tps[1] * 1.15 < tps[2]


MESH_ROWS = [r for r in BENCH.ROWS if r.tp > 1 or r.cp > 1]


def test_mesh_rows_are_the_published_ones():
    # published.md: the CP row and the four TP rows (bf16 / Float8 tensorwise, vanilla / async)
    assert sorted((r.tp, r.cp, r.tokens_per_s) for r in MESH_ROWS) == [
        (1, 2, 2540), (8, 1, 4378), (8, 1, 4809), (8, 1, 5078), (8, 1, 5570)]
    assert all(r.micro_batch == 12 and r.gpus == 64 and r.checkpointing == "selective-op" for r in MESH_ROWS
               if r.tp > 1)


def test_async_tp_gains_as_published():
    # published: async TP 4,809 / 4,378 = 1.098 (bf16), 5,570 / 5,078 = 1.097 (Float8 tensorwise); the model's
    # gain must be real (> 5%) and of that order (< 20%), and Float8 must beat bf16 either way
    tps = {r.options: BENCH.predict(r).time.tokens_per_s_per_gpu for r in MESH_ROWS if r.tp > 1}
    for vanilla, overlapped in ((("compile",), ("compile", "async_tp")),
                                (("compile", "float8"), ("compile", "float8", "async_tp"))):
        assert 1.05 < tps[overlapped] / tps[vanilla] < 1.20, (vanilla, tps)
    assert tps[("compile", "float8")] > tps[("compile",)]
    assert tps[("compile", "float8", "async_tp")] > tps[("compile", "async_tp")]


def test_mesh_rows_price_their_collectives():
    for row in MESH_ROWS:
        t = BENCH.predict(row).time
        if row.tp > 1:
            assert t.tp_comm_s > 0 and (t.tp_exposed_comm_s < t.tp_comm_s) == ("async_tp" in row.options)
        if row.cp > 1:
            assert 0 < t.cp_exposed_comm_s < t.cp_comm_s  # the ring hides behind the attention (the last permute)
