"""A co-located rollout engine's GPU memory by the engine's own rule (vLLM v1, SGLang): weights, KV cache, KV
capacity as concurrent sequences, and the errors the engine raises at start, as typed refusals.

Each rule names the file and function it is read from and the versions it holds for
(shared/reference/rl.md). Bytes are per GPU; the engine runs tensor parallel over `tp` GPUs, so weights and KV
heads divide by tp (vLLM ModelConfig.get_num_kv_heads: max(1, kv_heads // tp); MLA's latent is not split).
What the rules measure at start (the trainer's resident bytes, the profile run's peak) the caller passes in:
this module only applies the engine's arithmetic. Estimates (not the engine's code): the profile run's
activation peak and the CUDA-graph pool (profile_run_peak_bytes, CUDA_GRAPH_BYTES_ESTIMATE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from .feasibility import Refusal
from .model_spec import ModelSpec
from .rollout_lora import vllm_lora_buffers
from .rollout_lora_sglang import SGLANG_MAX_LORAS_PER_BATCH, adapter_refusals, one_slot_bytes, sglang_lora_pool
from .spec_values import SpecError, check_positive, parse_enum
from .units import GiB


class Engine(str, Enum):
    VLLM = "vllm"
    SGLANG = "sglang"


# The rule each engine version runs (vllm_rule_v08 / vllm_rule_current / sglang_rule): "0.8" is vLLM v1 of
# 0.8.x (verl's 2025 pin); "current" is vLLM >= 0.10 (MemorySnapshot-based profiling) and SGLang >= 0.4.
ENGINE_VERSIONS = {Engine.VLLM: ("0.8", "current"), Engine.SGLANG: ("current",)}

# The CUDA-graph pool vLLM captures after sizing the KV cache (outside its budget): vLLM logs it ("Graph
# capturing finished in N secs, took X GiB"); user logs of 7-14B models at TP 1-2 show about 0.3-1 GiB. An
# estimate, not the engine's code: 0.5 GiB.
CUDA_GRAPH_BYTES_ESTIMATE = GiB // 2


@dataclass(frozen=True)
class KvShape:
    """What one token's KV cache holds per layer: K and V of kv_heads x head_dim, or MLA's one latent + rope."""

    layers: int
    kv_heads: int
    head_dim: int
    mla_latent_dim: int = 0   # DeepSeek MLA: kv_lora_rank (0 = not MLA)
    mla_rope_dim: int = 0     # qk_rope_head_dim

    @classmethod
    def of(cls, model: ModelSpec) -> "KvShape":
        return cls(model.n_layers, model.n_kv_heads, model.head_dim, model.kv_lora_rank, model.qk_rope_head_dim)

    def token_bytes_per_layer(self, tp: int, dtype_bytes: int) -> int:
        """Bytes of one token in one layer on one TP rank."""
        if self.mla_latent_dim:  # vllm/v1/kv_cache_interface.py MLAAttentionSpec: one head, K only, not split
            return (self.mla_latent_dim + self.mla_rope_dim) * dtype_bytes
        return 2 * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class EngineSettings:
    """The engine's knobs as verl's rollout config names them (actor_rollout_ref.rollout.*)."""

    engine: Engine = Engine.VLLM
    version: str = "current"
    gpu_memory_utilization: float = 0.5   # vLLM: of total memory; SGLang (mem_fraction_static): of free at start
    tp: int = 1                           # tensor_model_parallel_size
    max_model_len: int = 2048             # prompt + response
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enforce_eager: bool = False           # no CUDA graphs
    block_size: int = 16                  # vLLM's KV block (SGLang: page size 1)
    kv_dtype_bytes: int = 2
    weight_dtype_bytes: int = 2           # bf16 rollout weights
    cuda_graph_bytes: int = CUDA_GRAPH_BYTES_ESTIMATE
    max_lora_rank: int = 0                # enable_lora's (verl: a LoRA adapter served, rollout_lora.py); 0 = off
    max_loras_per_batch: int = SGLANG_MAX_LORAS_PER_BATCH   # SGLang's LoRA pool slots (rollout_lora_sglang.py)
    # SGLang's lora_target_modules as its pool names them (rollout_lora_sglang.sglang_target_modules of verl's
    # model.target_modules); None: "all" (verl's all-linear). vLLM takes none: its buffers wrap every linear
    lora_target_modules: frozenset[str] | None = None

    def __post_init__(self):
        object.__setattr__(self, "engine", parse_enum(Engine, self.engine, "engine"))
        if self.version not in ENGINE_VERSIONS[self.engine]:
            raise SpecError("engine_version", f"{self.version!r} for {self.engine.value}; choose one of: "
                            f"{', '.join(ENGINE_VERSIONS[self.engine])}")
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise SpecError("gpu_memory_utilization", f"must be in (0, 1], got {u!r}")
        for name in ("tp", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "max_loras_per_batch"):
            check_positive(name, getattr(self, name))

    @property
    def page_tokens(self) -> int:
        return self.block_size if self.engine is Engine.VLLM else 1

    @property
    def graph_bytes(self) -> int:
        return 0 if self.enforce_eager else self.cuda_graph_bytes


@dataclass(frozen=True)
class EngineMemory:
    """One GPU of the engine awake: weights, the KV cache it sized, its profile-run peak and CUDA graphs."""

    weights_bytes: int
    activation_peak_bytes: int    # the forward at max_num_batched_tokens + the sampler's (inside the budget)
    cuda_graph_bytes: int         # outside the budget
    kv_bytes: int                 # num blocks x page x layers (0 when it cannot start)
    kv_blocks: int                # vLLM blocks of block_size tokens (SGLang: tokens)
    page_bytes: int               # one block of one layer
    kv_tokens: int
    max_concurrent_seqs: int      # sequences of max_model_len the KV cache holds at once (<= max_num_seqs)
    refusals: tuple[Refusal, ...] = ()
    available_bytes: int = 0      # what the rule left for the KV cache, before the blocks' floor
    lora_bytes: int = 0           # the LoRA buffers: vLLM's (rollout_lora.py, counted as weights, in their sleep
                                  # pool) or SGLang's pool (rollout_lora_sglang.py, never released)
    lora_read_bytes: int = 0      # what a decode step reads of them: vLLM's one slot whole, SGLang's one slot of its
                                  # max_loras_per_batch (verl's one adapter)

    @property
    def awake_bytes(self) -> int:
        """What the engine holds on the GPU while generating."""
        return self.weights_pool_bytes + self.kv_bytes + self.activation_peak_bytes + self.cuda_graph_bytes

    @property
    def weights_pool_bytes(self) -> int:
        """What vLLM allocates in load_model under its sleep allocator's "weights" tag: the weights and the LoRA
        buffers (level 1 backs them up to the host, level 2 discards them)."""
        return self.weights_bytes + self.lora_bytes

    @property
    def decode_read_bytes(self) -> int:
        """What each decode step reads besides the KV cache: the weights and the served adapter's slot."""
        return self.weights_bytes + self.lora_read_bytes


def weight_bytes_per_gpu(model: ModelSpec, tp: int, dtype_bytes: int = 2) -> int:
    """The engine's weights on one GPU: every parameter / tp (column / row / vocab-parallel layers)."""
    return math.ceil(model.n_params * dtype_bytes / tp)


def kv_page_bytes(shape: KvShape, block_size: int, tp: int, dtype_bytes: int) -> int:
    """vllm/v1/kv_cache_interface.py AttentionSpec.page_size_bytes (0.8 and current): block_size tokens x
    2 (K, V) x kv_heads / tp x head_dim x dtype bytes; MLA: block_size x (latent + rope) x dtype bytes."""
    return block_size * shape.token_bytes_per_layer(tp, dtype_bytes)


def num_kv_blocks(available_bytes: int, page_bytes: int, layers: int) -> int:
    """vllm/v1/core/kv_cache_utils.py get_num_blocks (0.8 and current): available // page_size // num_layers."""
    return max(0, available_bytes // page_bytes // layers)


def profile_run_peak_bytes(model: ModelSpec, s: EngineSettings, dtype_bytes: int = 2) -> int:
    """An estimate of vLLM's profile run (gpu_model_runner.profile_run: a forward of max_num_batched_tokens tokens,
    then the sampler on max_num_seqs rows): per token the hidden state and residual (2h), the qkv output
    ((q + 2 kv) / tp) and the gated MLP's gate_up and activation outputs (3 f / tp) in bf16; the sampler's fp32
    logits and probabilities (2 x vocab x 4 B per row, the vocabulary gathered: LogitsProcessor._gather_logits).
    Not read from vLLM's code: its measured peak also holds the attention backend's workspaces."""
    h, f, tp = model.hidden_size, model.ffn_hidden_size, s.tp
    per_token = 2 * h + (model.q_dim + 2 * model.kv_dim) // tp + (3 if model.gated_mlp else 2) * f // tp
    sampler = 2 * s.max_num_seqs * model.vocab_size * 4
    return s.max_num_batched_tokens * per_token * dtype_bytes + sampler


def vllm_rule_v08(total_bytes: int, s: EngineSettings, torch_peak_bytes: int, non_torch_bytes: int) -> int:
    """vLLM v1 0.8.x, vllm/v1/worker/gpu_worker.py Worker.determine_available_memory: KV bytes = total x
    gpu_memory_utilization - (torch's allocated peak after the profile run + the memory used outside torch).
    torch's peak counts every tensor of the process, so a co-located trainer's resident tensors shrink the KV
    cache; CUDA graphs are captured afterwards, outside the budget."""
    return int(total_bytes * s.gpu_memory_utilization) - torch_peak_bytes - non_torch_bytes


def vllm_rule_current(total_bytes: int, free_at_start_bytes: int, s: EngineSettings, weights_bytes: int,
                      profile_increase_bytes: int, non_torch_increase_bytes: int) -> tuple[int, Refusal | None]:
    """vLLM >= 0.10, vllm/v1/worker/gpu_worker.py (init_device's MemorySnapshot check, then
    determine_available_memory with utils.memory_profiling): it refuses to start when free memory < total x
    utilization; KV bytes = total x utilization - (weights + the profile run's torch peak increase + the
    non-torch increase), all measured from the start snapshot (a co-located trainer's tensors only through the
    start check). CUDA graphs sit outside the budget."""
    requested = int(total_bytes * s.gpu_memory_utilization)
    if free_at_start_bytes < requested:
        return 0, Refusal(
            "gpu_memory_utilization", "engine-start",
            f"vLLM: Free memory on device ({free_at_start_bytes / GiB:.2f}/{total_bytes / GiB:.2f} GiB) on startup "
            f"is less than desired GPU memory utilization ({s.gpu_memory_utilization}, {requested / GiB:.2f} GiB)",
            "lower --gpu-memory-utilization, or offload the actor before the engine starts")
    return requested - weights_bytes - profile_increase_bytes - non_torch_increase_bytes, None


def sglang_rule(free_before_load_bytes: int, free_after_load_bytes: int, mem_fraction_static: float) -> int:
    """SGLang, python/sglang/srt/model_executor/model_runner.py ModelRunner.profile_max_num_token: rest =
    free after loading the weights - free before loading x (1 - mem_fraction_static); the KV pool takes rest.
    The fraction is of the FREE memory at start (after NCCL init), not of the total as in vLLM."""
    return int(free_after_load_bytes - free_before_load_bytes * (1 - mem_fraction_static))


def kv_fit_refusals(engine: Engine, kv_bytes: int, one_seq_bytes: int, max_model_len: int) -> list[Refusal]:
    """The errors the engine raises when its KV cache is empty or cannot hold one sequence of max_model_len:
    vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory (0.8 and current); SGLang model_runner's
    "Not enough memory. Please try to increase --mem-fraction-static." (max_total_num_tokens <= 0)."""
    fix = "raise --gpu-memory-utilization, lower the response length, or offload more of the actor"
    if engine is Engine.SGLANG:
        return [] if kv_bytes > 0 else [Refusal("gpu_memory_utilization", "engine-no-kv",
                                                "SGLang: Not enough memory. Please try to increase "
                                                "--mem-fraction-static", fix)]
    if kv_bytes <= 0:
        return [Refusal("gpu_memory_utilization", "engine-no-kv", "vLLM: No available memory for the cache "
                        "blocks. Try increasing `gpu_memory_utilization` when initializing the engine", fix)]
    if one_seq_bytes > kv_bytes:
        return [Refusal("gpu_memory_utilization", "engine-max-len",
                        f"vLLM: To serve at least one request with the models's max seq len ({max_model_len}), "
                        f"({one_seq_bytes / GiB:.2f} GiB KV cache is needed, which is larger than the available KV "
                        f"cache memory ({kv_bytes / GiB:.2f} GiB)", fix)]
    return []


def scheduler_refusals(s: EngineSettings) -> list[Refusal]:
    """vLLM's SchedulerConfig._verify_args (vllm/config.py in 0.8, vllm/config/scheduler.py since): each step
    schedules at most max_num_batched_tokens tokens, one per running sequence at least, so it must be >=
    max_num_seqs. (Below max_model_len is allowed: chunked prefill, on in vLLM v1 and in verl's rollout config.)"""
    if s.engine is not Engine.VLLM or s.max_num_batched_tokens >= s.max_num_seqs:
        return []
    return [Refusal("max_num_batched_tokens", "engine-config", f"vLLM: max_num_batched_tokens "
                    f"({s.max_num_batched_tokens}) must be greater than or equal to max_num_seqs ({s.max_num_seqs})",
                    f"raise --max-num-batched-tokens to >= {s.max_num_seqs} or lower --max-num-seqs")]


def engine_memory(model: ModelSpec, s: EngineSettings, total_bytes: int, resident_bytes: int,
                  non_torch_bytes: int) -> EngineMemory:
    """The engine on one GPU, started beside `resident_bytes` of the trainer's tensors (allocated by torch in the
    same process) with `non_torch_bytes` outside torch (CUDA context, NCCL): its rule by engine and version."""
    weights = weight_bytes_per_gpu(model, s.tp, s.weight_dtype_bytes)
    # vLLM's LoRA buffers, allocated in load_model beside the weights: its model_memory_usage (current) or torch's
    # peak (0.8) counts them, so they come out of the KV budget (rollout_lora.py); SGLang's pool, built after the
    # weights and before the KV cache is sized, likewise (rollout_lora_sglang.py)
    lora, lora_read = lora_bytes(model, s)
    acts = profile_run_peak_bytes(model, s)
    shape = KvShape.of(model)
    refusals: list[Refusal] = []
    if s.engine is Engine.SGLANG:
        free_before = total_bytes - resident_bytes - non_torch_bytes
        available = sglang_rule(free_before, free_before - weights - lora, s.gpu_memory_utilization)
        acts = 0  # SGLang keeps its activations in the (1 - fraction) left outside the static pool
    elif s.version == "0.8":
        available = vllm_rule_v08(total_bytes, s, resident_bytes + weights + lora + acts, non_torch_bytes)
    else:
        available, refused = vllm_rule_current(total_bytes, total_bytes - resident_bytes - non_torch_bytes, s,
                                               weights + lora, acts, 0)
        refusals += [refused] if refused else []
    page = kv_page_bytes(shape, s.page_tokens, s.tp, s.kv_dtype_bytes)
    blocks = num_kv_blocks(max(available, 0), page, shape.layers)
    kv = blocks * page * shape.layers
    seq_pages = math.ceil(s.max_model_len / s.page_tokens)
    if not refusals:
        refusals += kv_fit_refusals(s.engine, kv, seq_pages * page * shape.layers, s.max_model_len)
    refusals = scheduler_refusals(s) + refusals
    if s.engine is Engine.SGLANG and s.max_lora_rank:   # an adapter SGLang's loader raises on
        refusals += adapter_refusals(model, s.lora_target_modules)
    return EngineMemory(weights_bytes=weights, activation_peak_bytes=acts, cuda_graph_bytes=s.graph_bytes,
                        kv_bytes=kv, kv_blocks=blocks, page_bytes=page, kv_tokens=blocks * s.page_tokens,
                        max_concurrent_seqs=min(s.max_num_seqs, blocks // seq_pages), refusals=tuple(refusals),
                        available_bytes=available, lora_bytes=lora, lora_read_bytes=lora_read)


def lora_bytes(model: ModelSpec, s: EngineSettings) -> tuple[int, int]:
    """(the engine's LoRA buffers on one GPU, what a decode step reads of them) where it serves an adapter."""
    if not s.max_lora_rank:
        return 0, 0
    if s.engine is Engine.VLLM:   # verl's max_loras 1: one slot, read whole
        total = vllm_lora_buffers(model, s.tp, s.max_lora_rank, s.weight_dtype_bytes, s.version,
                                  s.max_num_batched_tokens, s.max_num_seqs).total_bytes
        return total, total
    # the backend's graph metadata at the decode graph's largest batch, max_running_requests (verl's max_num_seqs) at
    # most; a decode step reads one slot's pool and its metadata
    max_bs = 0 if s.enforce_eager else s.max_num_seqs
    pool = sglang_lora_pool(model, s.tp, s.max_lora_rank, s.weight_dtype_bytes, s.max_loras_per_batch,
                            targets=s.lora_target_modules, max_bs=max_bs)
    return pool.total_bytes, one_slot_bytes(model, pool, s.max_loras_per_batch, max_bs, s.lora_target_modules)
