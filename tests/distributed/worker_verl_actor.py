"""torchrun worker: verl 0.9.1's own actor update on CPU ranks (gloo), its per-rank peak measured by
calibration.memtrack. What runs is verl's code: FSDPEngineWithLMHead (workers/engine/fsdp/transformer_impl.py, the
successor of 2025's dp_actor.DataParallelPPOActor) built by its initialize() - the HF model from its checkpoint in
fp32 (model_dtype), peft LoRA all-linear, verl's monkey patch for remove-padding and Ulysses, gradient checkpointing,
FSDP1 with MixedPrecision(bf16, fp32 reduce) and verl's wrap policy, AdamW - and its train_batch with
workers/utils/losses.ppo_loss on a rollout batch made no-padding by verl's left_right_2_no_padding.

What a CPU needs, and nothing else (each a context undone after the case):
- a verl platform for the CPU (verl registers CUDA, NPU, ROCm and MetaX only): device "cpu", gloo;
- flash-attn's varlen kernel, which verl's remove-padding path calls through transformers'
  _flash_attention_forward (verl's _ulysses_flash_attention_forward wraps it: repeat_kv and the all-to-alls): a
  stand-in with flash-attn 2's autograd memory - it saves q, k, v, the output and the fp32 log-sum-exp [heads,
  tokens] and recomputes in backward, with flash's fp32 dq accumulator (and dk / dv at the query heads under GQA);
  each sequence's attention is torch's SDPA. The model is built with sdpa (from_pretrained refuses
  flash_attention_2 without flash-attn) and switched to flash_attention_2, verl's default, before wrapping;
- FSDP1 with sync_module_states=False (FSDP1 broadcasts module states from GPU memory only) and every rank loading
  the checkpoint (verl builds ranks > 0 on the meta device and fills them by that broadcast);
- verl's patch of TRL's value-head model skipped (TRL 1.16, installed for the TRL planner, has no such class; the
  actor has no value head).
On a GPU verl computes log-probs with flash-attn's Triton cross-entropy; here its fallback (logprobs_from_logits_v2)
runs, and the entropy is eager (use_torch_compile False: inductor's buffers bypass the dispatcher the tracker
watches). The eager entropy's backward holds seven [tokens, vocab] tensors, the peak, whichever log-prob function
runs beside it (tests/unit/test_rl_logits_trace.py).

Case: {"hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "prompt", "response", "seqs": [sequences per rank
per measured micro-batch, ...], "sp": Ulysses degree, "fsdp_size" (optional, verl's default -1: every rank; 1: a
one-rank shard group, which FSDP1 runs as NO_SHARD), "gc" (optional, default True: gradient checkpointing), "strategy" (fsdp, the default, or fsdp2)}. Each sequence is prompt + response tokens, one micro-batch a
step; a warm-up step (Adam's states) runs first, then one measured step per entry of "seqs"."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from functools import partial
from types import ModuleType
from unittest import mock

import torch
import torch.distributed as dist

from tests.distributed.cases import serve_cli


class _VarlenAttention(torch.autograd.Function):
    """flash_attn_varlen_func's autograd memory (flash_attn_interface.FlashAttnVarlenFunc): saves q, k, v, out and
    the fp32 softmax_lse; the backward allocates dq, dk, dv, the fp32 dq_accum and softmax_d, and dk / dv at the
    query heads when they differ from the KV heads."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        bounds = cu_seqlens.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True,
                scale=scale, enable_gqa=True).transpose(0, 1)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, _out, _lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        workspace = [torch.empty(q.shape, dtype=torch.float32), torch.empty(q.shape[1], q.shape[0])]
        if q.shape[1] != k.shape[1]:
            workspace += [torch.empty(k.shape[0], *q.shape[1:], dtype=k.dtype) for _ in range(2)]
        bounds = cu_seqlens.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            with torch.enable_grad():
                qs, ks, vs = (x[a:b].detach().transpose(0, 1).requires_grad_() for x in (q, k, v))
                out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=ctx.scale,
                                                                       enable_gqa=True)
                grads = torch.autograd.grad(out, (qs, ks, vs), dout[a:b].transpose(0, 1))
            for full, g in zip((dq, dk, dv), grads):
                full[a:b] = g.transpose(0, 1)
        del workspace
        return dq, dk, dv, None, None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False):
    assert causal and dropout_p == 0.0
    return _VarlenAttention.apply(q, k, v, cu_seqlens_q, softmax_scale or q.shape[-1] ** -0.5)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    b, s = q.shape[:2]
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    flat = (x.reshape(b * s, *x.shape[2:]) for x in (q, k, v))
    return flash_attn_varlen_func(*flat, cu, cu, s, s, softmax_scale=softmax_scale, causal=causal).view(q.shape)


def _cpu_platform():
    """verl's platform plugin (plugin/platform/platform_base.py) for CPU ranks."""
    from verl.plugin.platform.platform_base import PlatformBase

    device = ModuleType("cpu_device")
    device.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
    device.empty_cache = lambda: None
    device.memory_allocated = device.memory_reserved = device.max_memory_allocated = lambda *a: 0
    device.max_memory_reserved = lambda *a: 0
    device.mem_get_info = lambda *a: (0, 0)

    class PlatformCPU(PlatformBase):
        device_name = vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: device)
        is_available = lambda self: True  # noqa: E731
        current_device = lambda self: torch.device("cpu")  # noqa: E731
        device_count = lambda self: 1  # noqa: E731
        communication_backend_name = lambda self: "gloo"  # noqa: E731
        get_device_capability = lambda self, device_index=0: (None, None)  # noqa: E731
        nvtx_range = lambda self, msg: contextlib.nullcontext()  # noqa: E731
        ray_resource_name = lambda self: "CPU"  # noqa: E731
        visible_devices_envvar = lambda self: "CPU_VISIBLE_DEVICES"  # noqa: E731
        ray_noset_envvars = lambda self: []  # noqa: E731
        is_ipc_supported = lambda self: False  # noqa: E731
        cudart = lambda self: None  # noqa: E731

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_device(self, device_index): ...
        def synchronize(self, device_index=None): ...
        def set_allocator_settings(self, settings): ...
        def empty_cache(self): ...
        def profiler_start(self): ...
        def profiler_stop(self): ...

    return PlatformCPU()


@contextlib.contextmanager
def _on_cpu():
    """The CPU adaptations of the module docstring, undone on exit."""
    from verl.plugin.platform import platform_manager

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(platform_manager, "_current_platform", _cpu_platform()))
        stack.enter_context(_kernels_and_wrapping())
        import verl.workers.engine.fsdp.transformer_impl as verl_impl

        yield verl_impl


@contextlib.contextmanager
def _kernels_and_wrapping():
    import transformers.modeling_flash_attention_utils as fau
    import verl.models.transformers.monkey_patch as verl_patch
    import verl.workers.engine.fsdp.transformer_impl as verl_impl
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CpuFSDP(FullyShardedDataParallel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "sync_module_states": False})

    flash = dict(_loaded_implementation="flash_attention_2", _flash_fn=flash_attn_func,
                 _flash_varlen_fn=flash_attn_varlen_func, _flash_with_kvcache_fn=None, _pad_fn=fau._pad_input,
                 _unpad_fn=fau._unpad_input, _process_with_kvcache_kwargs_fn=dict,
                 _process_flash_kwargs_fn=fau._lazy_define_process_function(flash_attn_varlen_func))
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.multiple(fau, **flash))
        stack.enter_context(mock.patch.object(verl_patch, "is_trl_available", lambda: False))
        stack.enter_context(mock.patch.object(verl_impl, "FSDP", CpuFSDP))
        stack.enter_context(mock.patch.object(verl_impl, "device_name", "cpu"))   # read when first imported
        stack.enter_context(mock.patch.object(verl_impl, "get_init_weight_context_manager",
                                              lambda **kwargs: contextlib.nullcontext))
        yield


def _checkpoint(case: dict, rank: int) -> str:
    """A random Qwen2 checkpoint of the case's shape, written by rank 0 (untied head, as Qwen2.5-14B's)."""
    path = [None]
    if rank == 0:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(hidden_size=case["hidden"], intermediate_size=case["ffn"],
                             num_hidden_layers=case["layers"], num_attention_heads=case["heads"],
                             num_key_value_heads=case["kv_heads"], vocab_size=case["vocab"], tie_word_embeddings=False,
                             max_position_embeddings=8192, architectures=["Qwen2ForCausalLM"])
        torch.manual_seed(0)
        path[0] = tempfile.mkdtemp(prefix="verl_actor_")
        Qwen2ForCausalLM(config).save_pretrained(path[0])
    dist.broadcast_object_list(path)
    return path[0]


def _engine(verl_impl, path: str, sp: int, fsdp_size: int = -1, gc: bool = True, strategy: str = "fsdp"):
    """verl's actor engine as its worker builds it (LoRA 32 all-linear, fp32 model, FSDP1, remove-padding,
    gradient checkpointing), the entropy eager."""
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.config.checkpoint import CheckpointConfig

    class Engine(verl_impl.FSDPEngineWithLMHead):
        def _build_module(self):
            module = super()._build_module()
            module.config._attn_implementation = "flash_attention_2"
            return module

    model = HFModelConfig(path=path, load_tokenizer=False, lora_rank=32, lora_alpha=32, target_modules="all-linear",
                          use_remove_padding=True, enable_gradient_checkpointing=gc,
                          override_config={"attn_implementation": "sdpa"})
    engine = FSDPEngineConfig(strategy=strategy, model_dtype="fp32", ulysses_sequence_parallel_size=sp,
                              fsdp_size=fsdp_size, use_torch_compile=False, use_dynamic_bsz=False)
    built = Engine(model, engine, FSDPOptimizerConfig(lr=1e-5), CheckpointConfig())
    built.initialize()
    return built


def _batch(case: dict, seqs: int):
    """A rollout batch as verl's trainer hands it to the update (every row prompt + response long), made
    no-padding by verl, with the update's flags (ray_trainer._update_actor, engine_workers.train_batch)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seqs)
    p, r, v = case["prompt"], case["response"], case["vocab"]
    td = left_right_2_no_padding(TensorDict({
        "input_ids": torch.randint(0, v, (seqs, p + r), generator=g),
        "attention_mask": torch.ones(seqs, p + r, dtype=torch.int64),
        "position_ids": torch.arange(p + r).expand(seqs, p + r).clone(),
        "prompts": torch.randint(0, v, (seqs, p), generator=g),
        "responses": torch.randint(0, v, (seqs, r), generator=g),
        "response_mask": torch.ones(seqs, r, dtype=torch.int64),
        "old_log_probs": torch.zeros(seqs, r),
        "advantages": torch.randn(seqs, r, generator=g)}, batch_size=[seqs]))
    tu.assign_non_tensor(td, calculate_entropy=True, temperature=1.0, global_batch_size=seqs, use_remove_padding=True,
                         use_dynamic_bsz=False, micro_batch_size_per_gpu=seqs, use_fused_kernels=False,
                         compute_loss=True)
    return td


def run_case(case: dict, rank: int, world: int) -> dict:
    from calibration.memtrack import MemoryTracker
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    path = _checkpoint(case, rank)
    rows = []
    try:
        with _on_cpu() as verl_impl:
            engine = _engine(verl_impl, path, case["sp"], case.get("fsdp_size", -1), case.get("gc", True),
                             case.get("strategy", "fsdp"))
            loss = partial(ppo_loss, config=FSDPActorConfig(strategy=case.get("strategy", "fsdp"), ppo_mini_batch_size=1,
                                                            ppo_micro_batch_size_per_gpu=1, rollout_n=1))
            with engine.train_mode():
                engine.train_batch(_batch(case, case["seqs"][0]), loss_function=loss)   # warm-up: Adam's states
            for seqs in case["seqs"]:
                batch = _batch(case, seqs)
                # a tracker per step, made after the last: one kept through a step holds its embedding output
                # (peft's enable_input_require_grads makes it a leaf) and that output's gradient into the next
                tracker = MemoryTracker(engine.module, engine.optimizer, vocab_size=case["vocab"])
                with engine.train_mode(), tracker:
                    engine.train_batch(batch, loss_function=loss)
                snap = tracker.snapshot()
                rows.append({"seqs": seqs, "tokens": seqs * (case["prompt"] + case["response"]) // case["sp"],
                             **snap.to_dict()})
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    return {"ranks": gathered}


if __name__ == "__main__":
    serve_cli(run_case)
