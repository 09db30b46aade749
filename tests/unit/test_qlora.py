"""cost_models/qlora.py's sizes against the QLoRA paper (Dettmers et al. 2023, section 3: double quantization
costs 8/64 + 32/(64 x 256) = 0.127 bits a weight, single 32/64 = 0.5) and against bitsandbytes' own
quantize_4bit on CPU (skipped without bitsandbytes); and the spec fields' one-line refusals."""

from __future__ import annotations

import pytest

from cost_models import qlora
from cost_models.specs import SpecError, TrainingSpec

N = 8192 * 28672  # Llama 3.1 70B's gate_proj (in x out)


def test_double_quantization_costs_0127_bits_per_weight():
    tables = (1 + qlora.CODE_ENTRIES + qlora.NESTED_CODE_ENTRIES) * 4  # offset and code tables: per tensor
    bits = (qlora.quant_state_bytes(N, True) - tables) * 8 / N
    assert bits == pytest.approx(8 / 64 + 32 / (64 * 256), rel=1e-9)
    assert round(bits, 3) == 0.127
    single = (qlora.quant_state_bytes(N, False) - qlora.CODE_ENTRIES * 4) * 8 / N
    assert single == 0.5
    assert qlora.packed_bytes(N) * 8 / N == 4


def test_sizes_equal_bitsandbytes_quantize_4bit():
    torch = pytest.importorskip("torch")
    F = pytest.importorskip("bitsandbytes.functional", reason="pip install --no-deps bitsandbytes==0.50.2")
    for out_f, in_f in ((256, 512), (1024, 384)):
        w = torch.randn(out_f, in_f, dtype=torch.bfloat16)
        for dq in (False, True):
            packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=dq, quant_type="nf4",
                                            quant_storage=torch.bfloat16)
            assert packed.nbytes == qlora.packed_bytes(w.numel())
            tensors = [state.absmax, state.code] + ([state.offset, state.state2.absmax, state.state2.code]
                                                    if dq else [])
            assert sum(t.nbytes for t in tensors) == qlora.quant_state_bytes(w.numel(), dq)


@pytest.mark.parametrize("field, value, words", [("quant", "int4", "choose one of: nf4, fp4"),
                                                 ("quant_storage", "int8", "choose one of: bf16, fp16, fp32, uint8"),
                                                 ("double_quant", "yes", "true or false")])
def test_bad_quantization_values_name_the_field_and_choices(field, value, words):
    with pytest.raises(SpecError) as err:
        TrainingSpec(finetune="qlora", **{field: value})
    assert err.value.field == field and words in str(err.value)


def test_cli_refuses_a_bad_quant_value_in_one_line_with_exit_2():
    from tests.doctor.cli_run import cli_process

    r = cli_process(["estimate", "--model", "llama3-8b", "--gpus", "2", "--finetune", "qlora", "--quant-storage",
                     "int8"])
    assert r.returncode == 2
    assert r.stderr.strip() == "error: quant_storage: unknown value 'int8'; choose one of: bf16, fp16, fp32, uint8"


def test_trace_refuses_qlora_rather_than_tracing_an_unquantized_base():
    from calibration.trace_limits import TraceUnsupported, _check_supported
    from cost_models.specs import FsdpConfig

    with pytest.raises(TraceUnsupported, match="builds no bitsandbytes 4-bit base"):
        _check_supported(FsdpConfig(), TrainingSpec(finetune="qlora"))


def test_step_time_adds_each_blocks_dequantization_forward_backward_and_recompute():
    """One GPU (no collectives, no FSDP copies): QLoRA's memory-bound time is LoRA's plus (2 L + checkpointed
    blocks) dequantizations of a block, each reading the packed weights and absmax and writing bf16 weights.
    Llama 3 8B's block: 4096^2 x 2 + 4096 x 1024 x 2 + 3 x 4096 x 14336 = 218,103,808 weights; moved
    n / 2 + n x 2 + absmax (n / 64 B + n / 16384 x 4 B + 7 x 273 x 4 B) = 109,051,904 + 436,207,616 +
    3,407,872 + 53,248 + 7,644 = 548,728,284 B."""
    from cost_models.kernel_time import Rates
    from cost_models.profile import DEFAULT_PROFILE
    from cost_models.specs import FsdpConfig
    from cost_models.step_time import estimate_step_time
    from planner.hardware import make_cluster
    from planner.models import load_preset

    spec, cluster = load_preset("llama3-8b"), make_cluster(1, gpu="h100-80gb")
    n = 218_103_808
    assert qlora.quantized_per_block(spec) == n
    moved = qlora.dequantize_bytes_moved_per_block(spec, 2, double_quant=True)
    assert moved == n // 2 + 2 * n + n // 64 + n // 16384 * 4 + 7 * 273 * 4 == 548_728_284
    rates = Rates.of(cluster.gpu, "bf16", DEFAULT_PROFILE, "flash2")
    for ac_every, checkpointed in ((0, 0), (1, 32), (4, 8)):
        config = FsdpConfig(sharding="NO_SHARD", ac_every=ac_every, micro_batch=2)
        times = [estimate_step_time(spec, cluster, TrainingSpec(seq_len=1024, finetune=f), config, DEFAULT_PROFILE)
                 for f in ("lora", "qlora")]
        extra = (2 * spec.n_layers + checkpointed) * rates.memory_s(moved)
        assert times[1].memory_bound_s - times[0].memory_bound_s == pytest.approx(extra, rel=1e-9)
        assert times[1].matmul_s == times[0].matmul_s



@pytest.mark.parametrize("n_in, n_out, double_quant, tokens", [(512, 1024, True, 64), (512, 1024, False, 64),
                                                                (1024, 384, True, 32), (2048, 2048, True, 16)])
def test_dequantized_weight_in_flight_measured_on_a_bitsandbytes_linear(n_in, n_out, double_quant, tokens):
    """One Linear4bit (bf16 compute and storage, nf4), forward and backward on CPU under calibration.memtrack (which
    counts gemm_4bit's own allocations): above the input, the forward holds the dequantized weight, the absmax and
    the output, and keeps only the output (MatMul4Bit saves the packed weight alone); the backward holds the weight
    dequantized again and the input gradient. Exact to the byte; on CPU bitsandbytes' default gemm_4bit keeps one
    dequantized absmax where CUDA's fallback keeps two (qlora.py), and at 16 tokens the absmax (2048 x 2048 / 64
    x 4 B = 262,144) outweighs the input gradient (16 x 2048 x 2 = 65,536)."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes", reason="pip install --no-deps bitsandbytes==0.50.2")
    from calibration.memtrack import MemoryTracker

    torch.manual_seed(0)
    linear = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                               compress_statistics=double_quant, quant_storage=torch.bfloat16)
    linear.weight = bnb.nn.Params4bit(torch.randn(n_out, n_in, dtype=torch.bfloat16), requires_grad=False,
                                      compress_statistics=double_quant, quant_type="nf4",
                                      quant_storage=torch.bfloat16)._quantize("cpu")
    module = torch.nn.Sequential(linear)
    x = torch.randn(tokens, n_in, dtype=torch.bfloat16, requires_grad=True)
    with MemoryTracker(module) as tracker:
        tracker.track_inputs(x)
        before = tracker.current_bytes()
        y = module(x)
        kept, forward = tracker.current_bytes() - before, tracker.snapshot().peak_allocated_bytes - before
        grad = torch.ones_like(y)
        y.backward(grad)  # its peak is above the forward's (it holds the output and its gradient besides)
        backward = tracker.snapshot().peak_allocated_bytes - before - kept - grad.nbytes
    n, c = n_in * n_out, 2
    one_absmax = qlora.absmax_dequantized_bytes(n, double_quant)
    assert one_absmax == (n // 64 * 4 if double_quant else 0)
    assert kept == tokens * n_out * c
    assert forward == qlora.forward_in_flight_bytes(n_in, n_out, c, double_quant, tokens) - one_absmax
    assert backward == qlora.backward_in_flight_bytes(n_in, n_out, c, double_quant, tokens)
    assert backward == n * c + max(one_absmax, tokens * n_in * c)

def test_storage_must_be_the_compute_dtype_and_the_plan_follows_it():
    from planner import estimate, plan
    from planner.errors import PlannerError

    with pytest.raises(PlannerError) as err:
        estimate("llama3-8b", 2, finetune="qlora", quant_storage="fp16", precision="bf16")
    assert err.value.field == "quant_storage" and "use --quant-storage bf16" in str(err.value)
    with pytest.raises(PlannerError, match="accelerate issue 3983"):
        plan("llama3-8b", 2, finetune="qlora", quant_storage="uint8")
    best = plan("llama3-8b", 2, gpu="a100-80gb", finetune="qlora", quant_storage="fp16").best
    assert best.config.precision.compute_dtype == "fp16"


def test_unpriced_models_and_float8_are_refused_in_one_line():
    from planner import estimate
    from planner.errors import PlannerError

    with pytest.raises(PlannerError, match="QLoRA is priced for dense blocks"):
        estimate("mixtral-8x7b", 8, finetune="qlora")
    with pytest.raises(PlannerError, match="Float8 linears with a 4-bit base"):
        estimate("llama3-8b", 2, gpu="h100-80gb", finetune="qlora", float8=True)


def test_stored_base_of_llama2_70b():
    """68,976,648,192 parameters, 68,451,041,280 of them in 80 blocks' linears: bf16 rest + packed linears
    = (68,976,648,192 - 68,451,041,280) x 2 + 68,451,041,280 / 2 = 1,051,213,824 + 34,225,520,640 B."""
    from planner.models import load_preset

    assert qlora.stored_base_bytes(load_preset("llama2-70b"), 2) == 1_051_213_824 + 34_225_520_640
