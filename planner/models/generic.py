"""Any causal LM transformers can build: the fallback for a model_type without a family reader.

    spec = resolve.from_transformers(cfg_dict, name="granite-8b")   # built here, read by resolve.from_module

The model is built from its config on the meta device (no memory, no weights), and everything is read
from what was built: exact parameter counts (module.py's split into blocks, embeddings, head and the rest),
the repeated block, the shapes, a mixture-of-experts layout (stacked expert tensors, top-k, leading dense
blocks) and which attention implementations the model class runs. Activation memory then comes from a
traced block memory profile (block_profiles.py), not from a formula.

Remote-code models (config.json with `auto_map`) are refused unless trust_remote_code is set; then the
config and the code are loaded from the model's directory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cost_models.specs import ModelSpec, MoeSpec, SpecError
from planner.errors import PlannerError, UnsupportedModel

# Config keys naming the routed experts and top-k, in the spellings of transformers' MoE configs.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")
_EXPERT_WIDTH_KEYS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")


def transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return "not installed"
    return transformers.__version__


def _require_transformers(model_type: str) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise PlannerError("model_type", f"{model_type!r} has no built-in reader; pricing it from its transformers "
                                         "implementation needs transformers: pip install 'fsdp-planner[hf]'") from None


def hf_config_object(cfg: dict, *, trust_remote_code: bool = False):
    """transformers' config object for a config dict; PlannerError (one line) when it cannot be made."""
    model_type = cfg.get("model_type")
    _require_transformers(model_type)
    if cfg.get("auto_map"):
        if not trust_remote_code:
            raise PlannerError("trust_remote_code", f"config of model_type {model_type!r} names custom modelling "
                                                    "code (auto_map); pass --trust-remote-code to run it")
        code_dir = cfg.get("_name_or_path")
        if not code_dir or not (Path(code_dir) / "config.json").is_file():
            raise PlannerError("model", "a remote-code model (auto_map) must be given as its directory (or its "
                                        "config.json there), which holds the code next to config.json")
    from calibration.build import hf_config_object as build_config

    try:
        return _quiet(lambda: build_config(cfg))
    except ValueError as exc:
        if "Unrecognized model identifier" in str(exc) or model_type not in _known_model_types():
            raise UnsupportedModel("model_type", f"{model_type!r} is not a model type transformers "
                                             f"{transformers_version()} can build") from None
        raise PlannerError("model", f"config of model_type {model_type!r}: {_first_line(exc)}") from None
    except (TypeError, KeyError, AttributeError, OSError) as exc:  # OSError: a code file (auto_map) missing
        raise PlannerError("model", f"config of model_type {model_type!r}: {_first_line(exc)}") from None


def _known_model_types() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _quiet(make):
    from calibration.build import quiet_transformers

    return quiet_transformers(make)


def build_on_meta(config, *, trust_remote_code: bool = False):
    """AutoModelForCausalLM.from_config on the meta device; PlannerError when transformers cannot."""
    import torch
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", "?")
    try:
        with torch.device("meta"):
            return _quiet(lambda: AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code))
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise UnsupportedModel("model_type", f"{model_type!r} is not a causal language model in transformers "
                                             f"{transformers_version()} (no AutoModelForCausalLM class)") from None
        raise PlannerError("model", f"transformers {transformers_version()} cannot build model_type "
                                    f"{model_type!r}: {_first_line(exc)}") from None
    except (TypeError, KeyError, AttributeError, RuntimeError, ImportError) as exc:
        raise PlannerError("model", f"transformers {transformers_version()} cannot build model_type "
                                    f"{model_type!r}: {type(exc).__name__}: {_first_line(exc)}") from None


def refine_from_module(spec: ModelSpec, model, blocks: list, cfg: dict) -> ModelSpec:
    """A generic spec inferred from a transformers module, with what the module itself tells: the attention
    implementations its class runs and its mixture-of-experts layout."""
    moe = _moe_layout(model, blocks, cfg)
    try:
        spec = dataclasses.replace(spec, attention_choices=attention_choices(model),
                                   eager_softmax_fp32=eager_softmax_fp32(blocks))
        return _with_moe(spec, moe, blocks) if moe else spec
    except SpecError as e:
        raise PlannerError("model", f"config of {spec.name!r}: {e}") from None


def attention_choices(model) -> tuple[str, ...]:
    """The implementations this model class runs in training: sdpa only where the class declares support
    (Gemma 2 and gpt-oss do not), eager always."""
    return ("sdpa", "eager") if getattr(type(model), "_supports_sdpa", False) else ("eager",)


def eager_softmax_fp32(blocks: list) -> bool | None:
    """Whether the model's eager attention takes its softmax in fp32 on bf16 scores: transformers'
    eager_attention_forward of the first attention module's file run on small CPU tensors with that module (Llama's
    softmax(..., dtype=torch.float32); Llama 4's plain softmax, modeling_llama4.py:267), the softmax's output dtype read
    at aten (however the file spells it: F.softmax, torch.softmax, Tensor.softmax). None where it cannot be run."""
    import sys

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    attention = next((m for b in blocks for m in b.modules() if type(m).__name__.endswith("Attention")), None)
    eager = getattr(sys.modules.get(type(attention).__module__), "eager_attention_forward", None)
    groups = getattr(attention, "num_key_value_groups", None)
    if eager is None or not isinstance(groups, int):
        return None
    q = torch.zeros(1, groups, 4, 8, dtype=torch.bfloat16)
    kv = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)

    class SoftmaxDtypes(TorchDispatchMode):
        dtypes: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket is torch.ops.aten._softmax:
                self.dtypes = self.dtypes + [out.dtype]
            return out

    recorded = SoftmaxDtypes()
    try:
        with recorded:
            eager(attention, q, kv, kv, None, scaling=1.0, dropout=0.0)
    except Exception:  # noqa: BLE001 - foreign code that needs more than these tensors: the family's rule
        return None
    return recorded.dtypes[0] == torch.float32 if recorded.dtypes else None


def _config_int(cfg: dict, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _moe_layout(model, blocks: list, cfg: dict) -> dict | None:
    """Routed experts as transformers stores them: 3-D parameters whose dim 0 is the expert count.
    None for a dense model."""
    n_experts = _config_int(cfg, _EXPERT_KEYS)
    top_k = _config_int(cfg, _TOP_K_KEYS)
    if not n_experts or not top_k:
        return None
    sparse = []
    for index, block in enumerate(blocks):
        stacked = [(name, p) for name, p in block.named_parameters() if p.dim() == 3 and p.shape[0] == n_experts]
        if stacked:
            sparse.append((index, block, stacked))
    if not sparse:
        return None
    index, block, stacked = sparse[0]
    sparse_indices = {i for i, _, _ in sparse}
    dense = [b for i, b in enumerate(blocks) if i not in sparse_indices]
    # dense blocks that all lead (DeepSeek) are profiled apart; interleaved ones (Llama 4) are averaged with
    # the sparse ones over the pattern (first_sparse 0)
    leading = sparse_indices == set(range(index, len(blocks)))
    return dict(n_experts=n_experts, top_k=min(top_k, n_experts), first_sparse=index if leading else 0, block=block,
                stacked=stacked, dense=dense, expert_width=_config_int(cfg, _EXPERT_WIDTH_KEYS) or 0,
                dense_layers=tuple(i for i in range(len(blocks)) if i not in sparse_indices))


def _mlp_widths(moe: dict, hidden: int) -> dict:
    """The MoE block's shared expert(s) and the dense blocks' MLP as the module holds them: the MoE module is the
    parent of the stacked experts' holder (Llama 4's feed_forward: transformers modeling_llama4.py Llama4TextMoe,
    whose shared_expert is a Llama4TextMLP of intermediate_size); its children that hold no expert-count rows (not
    the experts, not the router) are the shared expert(s) and their gate. A dense block's MLP is its submodule at the
    same path (Llama 4's dense feed_forward: a Llama4TextMLP of intermediate_size_mlp). A width is the input of an
    MLP's last linear back to the hidden size (its down projection); 0 where there is none."""
    holder = moe["stacked"][0][0].rpartition(".")[0]   # the experts' module; the MoE module its parent
    if "." not in holder:  # experts held by the block's MoE module itself (or the block): no siblings to read
        return dict(shared_width=0, dense_width=0, shared_params=0)
    path = holder.rpartition(".")[0]
    shared = [child for child in moe["block"].get_submodule(path).children()
              if not any(p.dim() >= 1 and p.shape[0] == moe["n_experts"] for p in child.parameters())]
    shared_width = sum(_down_width(child, hidden) for child in shared)
    dense_mlps = [b.get_submodule(path) for b in moe["dense"] if _has_submodule(b, path)]
    dense_width = _down_width(dense_mlps[0], hidden) if dense_mlps else 0
    return dict(shared_width=shared_width, dense_width=dense_width,
                shared_params=sum(_numel(child) for child in shared) if shared_width else 0)


def _has_submodule(module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _down_width(mlp, hidden: int) -> int:
    """in_features of an MLP's last nn.Linear that returns to the hidden size (gate, up, then down, as transformers
    registers them); 0 for a module with none (a router, a scalar gate)."""
    import torch

    linears = [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    last = linears[-1] if linears else None
    return last.in_features if last is not None and last.out_features == hidden else 0


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _with_moe(spec: ModelSpec, moe: dict, blocks: list) -> ModelSpec:
    """The spec with its MoE shape: block_params is the sparse block's, leading dense blocks apart; counts
    re-split so that n_params is unchanged."""
    block = moe["block"]
    n_dense = len(moe["dense"])
    stacked = tuple((p.shape[0], p[0].numel()) for _, p in moe["stacked"])
    expert_params = sum(per_expert for _, per_expert in stacked)
    router = sum(p.numel() for name, p in block.named_parameters()  # (E, h) weight, (E,) bias or score bias
                 if p.dim() <= 2 and p.shape[0] == moe["n_experts"] and ("gate" in name or "router" in name))
    width = moe["expert_width"] or max(min(p.shape[1:]) for _, p in moe["stacked"])
    # sparse blocks can differ (Qwen3-Next mixes linear- and full-attention layers): the floor of their mean,
    # the rest to the root, so that n_params stays exact
    sparse_blocks = [b for b in blocks if all(b is not d for d in moe["dense"])]
    sparse_params = sum(_numel(b) for b in sparse_blocks) // len(sparse_blocks)
    dense_params = sum(_numel(b) for b in moe["dense"]) // n_dense if n_dense else 0
    blocks_total = sum(_numel(b) for b in blocks)
    other = spec.root_other_params + spec.n_layers * spec.block_params - blocks_total
    remainder = blocks_total - n_dense * dense_params - (spec.n_layers - n_dense) * sparse_params
    widths = _mlp_widths(moe, spec.hidden_size)
    moe_spec = MoeSpec(n_experts=moe["n_experts"], experts_per_token=moe["top_k"], expert_ffn_size=width,
                       expert_params=expert_params, stacked_expert_tensors=stacked, router_params=router,
                       n_dense_layers=n_dense, first_sparse_layer=moe["first_sparse"], dense_block_params=dense_params,
                       dense_layers=moe["dense_layers"], shared_ffn_size=widths["shared_width"],
                       shared_params=widths["shared_params"],
                       dense_ffn_size=(widths["dense_width"] or spec.ffn_hidden_size) if n_dense else 0)
    return dataclasses.replace(spec, moe=moe_spec, block_params=sparse_params,
                               ffn_hidden_size=width, root_other_params=other + remainder)
