"""Reading an nn.Module's shapes (works on the meta device, allocates nothing): its repeated blocks, the parameter
split, head and attention shapes. resolve.from_module makes the ModelSpec from them."""

from __future__ import annotations

import sys

from planner.errors import PlannerError

from .config_reader import normalise_activation

# ---------------------------------------------------------------------------------------------
# nn.Module
# ---------------------------------------------------------------------------------------------

def is_module(obj) -> bool:
    # Without torch imported, obj cannot be an nn.Module: no need to import it to find out.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def hf_config_dict(module) -> dict | None:
    """`module.config.to_dict()` for a transformers model (anything with such a config), else None."""
    to_dict = getattr(getattr(module, "config", None), "to_dict", None)
    data = to_dict() if callable(to_dict) else None
    return data if isinstance(data, dict) else None


def find_blocks(module, class_name: str | None = None) -> list:
    """Instances of the block class: `class_name` when known (transformers), else the class whose
    instances, as children of an nn.ModuleList / nn.Sequential, hold the most parameters. Classes
    repeated at least twice win over single ones, so a Sequential(embedding, encoder, head) does not
    make the whole encoder a one-layer "block"."""
    import torch.nn as nn

    if class_name is not None:
        found = [m for m in module.modules() if type(m).__name__ == class_name]
        if found:
            return found
    members: dict[type, list] = {}
    for container in module.modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            for child in container.children():
                members.setdefault(type(child), []).append(child)
    scored = [(len(ms) >= 2, _numel(_unique_params(ms)), cls) for cls, ms in members.items()]
    scored = [s for s in scored if s[1] > 0]
    if not scored:
        raise PlannerError("model", f"no repeated block found in {type(module).__name__}: expected an "
                                    f"nn.ModuleList or nn.Sequential of blocks holding parameters")
    best = max(scored, key=lambda s: (s[0], s[1]))[2]  # max keeps the first (outermost) of equals
    return members[best]


def _unique_params(modules) -> dict:
    """id -> parameter over the modules, each shared (tied) parameter once, as .parameters() does."""
    return {id(p): p for m in modules for p in m.parameters()}


def _numel(params: dict) -> int:
    return sum(p.numel() for p in params.values())


def _measure_split(module, blocks: list) -> dict:
    """n_layers, block/embedding/head/root-other parameter counts, measured on the module."""
    import torch.nn as nn

    total = _unique_params([module])
    in_blocks = _unique_params(blocks)
    inside = {id(m) for b in blocks for m in b.modules()}
    outside = [m for m in module.modules() if id(m) not in inside]
    embeddings = {k: p for k, p in _unique_params([m for m in outside if isinstance(m, nn.Embedding)]).items()
                  if k not in in_blocks}
    head_module = _output_head(module, outside, embeddings)
    tied = head_module is not None and id(getattr(head_module, "weight", None)) in embeddings
    # A tied head adds nothing; an untied one counts its weight and bias (BERT's tied decoder bias
    # is the MLM head's `bias` parameter: root-other, like in from_hf_config).
    head = {} if head_module is None or tied else {
        k: p for k, p in _unique_params([head_module]).items() if k not in embeddings and k not in in_blocks}
    n_layers = len(blocks)
    # Blocks of one class can differ slightly (e.g. a first layer with extra parameters): the spec's
    # L identical blocks get the floor of the mean, the remainder goes to the root.
    block_params = _numel(in_blocks) // n_layers
    other = _numel(total) - n_layers * block_params - _numel(embeddings) - _numel(head)
    return dict(n_layers=n_layers, block_params=block_params, embedding_params=_numel(embeddings),
                head_params=_numel(head), root_other_params=other, tied_embeddings=tied)


def _output_head(module, outside: list, embeddings: dict):
    """The output projection: transformers' get_output_embeddings(), else the last nn.Linear outside
    the blocks whose output width is the vocabulary (the largest embedding table)."""
    import torch.nn as nn

    getter = getattr(module, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (AttributeError, NotImplementedError):
            head = None
        if isinstance(head, nn.Module):
            return head
    vocab = max((p.shape[0] for p in embeddings.values() if p.dim() == 2), default=None)
    heads = [m for m in outside if isinstance(m, nn.Linear) and m.out_features == vocab]
    return heads[-1] if heads else None


# -- generic shape inference ------------------------------------------------------------------

_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_heads", "n_head")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
_ATTENTION_LEAVES = {"q", "k", "v", "o", "qkv", "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
                     "wq", "wk", "wv", "wo", "wqkv", "query", "key", "value", "query_key_value", "c_attn"}
_DEFAULT_HEAD_DIM = 64  # when nothing names the head count: the common width of one head


def _infer_shapes(module, blocks: list, config: dict) -> dict:
    """Best-effort shape fields for a module we do not know: from the first block's layers, with
    standard HF config keys (when the module has a config) taking precedence."""
    import torch.nn as nn

    block = blocks[0]
    linears = [(qual, m) for qual, m in block.named_modules() if isinstance(m, nn.Linear)]
    inside = {id(m) for b in blocks for m in b.modules()}
    tables = [m for m in module.modules() if isinstance(m, nn.Embedding) and id(m) not in inside]
    token_table = max(tables, key=lambda m: m.num_embeddings, default=None)

    h = config.get("hidden_size") or (token_table.embedding_dim if token_table else _most_common_in(linears))
    vocab = config.get("vocab_size") or (token_table.num_embeddings if token_table else 1)
    down_widths = [m.in_features for _, m in linears if m.out_features == h and m.in_features != h]
    f = config.get("intermediate_size") or max(down_widths, default=4 * h)
    n_heads = config.get("num_attention_heads") or _int_attr(block, _HEAD_ATTRS) or _default_heads(h)
    n_kv = config.get("num_key_value_heads") or _int_attr(block, _KV_HEAD_ATTRS) or n_heads
    if n_heads % n_kv:
        n_kv = n_heads
    head_dim = config.get("head_dim") or _int_attr(block, ("head_dim",)) or max(1, h // n_heads)
    up_shapes = [(m.in_features, m.out_features) for _, m in linears]
    gated = up_shapes.count((h, f)) >= 2 or (h, 2 * f) in up_shapes
    return dict(
        hidden_size=h, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn_hidden_size=f,
        vocab_size=vocab, block_class=type(block).__name__, gated_mlp=gated,
        norm="rmsnorm" if any("rmsnorm" in type(m).__name__.lower() for m in block.modules()) else "layernorm",
        activation=_activation_of(block),
        dropout=_has_dropout(module), lora_target_shapes=_attention_shapes(block, linears),
        max_seq_len=config.get("max_position_embeddings") or 0,
    )


def _most_common_in(linears: list) -> int:
    widths = [m.in_features for _, m in linears]
    if not widths:
        raise PlannerError("model", "cannot infer the hidden size: the block has no nn.Linear and the "
                                    "model no nn.Embedding")
    return max(set(widths), key=widths.count)


def _default_heads(h: int) -> int:
    return h // _DEFAULT_HEAD_DIM if h % _DEFAULT_HEAD_DIM == 0 else 1


def _int_attr(block, names: tuple[str, ...]) -> int | None:
    for m in block.modules():
        for name in names:
            value = getattr(m, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _activation_of(block) -> str:
    import torch.nn as nn

    for m in block.modules():
        if isinstance(m, nn.GELU):
            return "gelu_tanh" if m.approximate == "tanh" else "gelu"
        for cls, name in ((nn.SiLU, "silu"), (nn.ReLU, "relu")):
            if isinstance(m, cls):
                return name
    # nn.TransformerEncoderLayer keeps its activation as a function attribute
    fn = getattr(block, "activation", None)
    fn_name = getattr(fn, "__name__", "")
    return normalise_activation(fn_name) if fn_name in ("relu", "gelu", "silu") else "gelu"


def _has_dropout(module) -> bool:
    import torch.nn as nn

    return any((isinstance(m, nn.Dropout) and m.p > 0)
               or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0) for m in module.modules())


def _attention_shapes(block, linears: list) -> tuple[tuple[int, int], ...]:
    """(in, out) of the attention projections: nn.MultiheadAttention's packed in_proj and out_proj,
    or linears named like q/k/v/o projections or living under an 'attn'/'attention' module."""
    import torch.nn as nn

    for m in block.modules():
        if isinstance(m, nn.MultiheadAttention):
            if m.in_proj_weight is not None:
                shapes = [(m.in_proj_weight.shape[1], m.in_proj_weight.shape[0])]
            else:
                shapes = [(w.shape[1], w.shape[0]) for w in (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)]
            return (*shapes, (m.out_proj.in_features, m.out_proj.out_features))
    shapes = []
    for qual, m in linears:
        parts = qual.lower().split(".")
        if parts[-1] in _ATTENTION_LEAVES or any("attn" in p or "attention" in p for p in parts[:-1]):
            shapes.append((m.in_features, m.out_features))
    return tuple(shapes)

