"""Typed reading of a Hugging Face config dict, and the parameter-count conventions of the modules
transformers builds (nn.Linear, Conv1D, LayerNorm). Every failure is a PlannerError naming the key."""

from __future__ import annotations

from planner.errors import PlannerError

REQUIRED = object()


class Cfg:
    """Typed, validated access to an HF config dict. `size(*keys)` takes a key and its aliases in
    the order transformers resolves them (its `attribute_map`); a None value counts as absent, as
    transformers treats it for the keys we read."""

    def __init__(self, data: dict, model_type: str):
        self.data = data
        self.model_type = model_type

    def _lookup(self, keys: tuple[str, ...]):
        for key in keys:
            if self.data.get(key) is not None:
                return key, self.data[key]
        return keys[0], None

    def size(self, *keys: str, default=REQUIRED) -> int:
        """A positive integer (layers, widths, heads, vocabulary)."""
        key, value = self._lookup(keys)
        if value is None:
            if default is REQUIRED:
                raise PlannerError("model", f"{self.model_type} config is missing required key {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlannerError("model", f"{self.model_type} config key {key!r} must be a positive integer, "
                                        f"got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, (bool, int)) or value not in (0, 1):
            raise PlannerError("model", f"{self.model_type} config key {key!r} must be true or false, got {value!r}")
        return bool(value)

    def any_dropout(self, **defaults: float) -> bool:
        """True when one of the given dropout probabilities (key=transformers default) is non-zero."""
        for key, default in defaults.items():
            value = self.data.get(key)
            if value is None:
                value = default
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise PlannerError("model", f"{self.model_type} config key {key!r} must be a probability in "
                                            f"[0, 1], got {value!r}")
            if value > 0:
                return True
        return False

    def text(self, key: str, default: str) -> str:
        value = self.data.get(key)
        return default if value is None else str(value)

    def divides(self, small_key: str, small: int, big_key: str, big: int) -> None:
        if big % small:
            raise PlannerError("model", f"{self.model_type} config: {big_key}={big} is not divisible by "
                                        f"{small_key}={small}")


# ---------------------------------------------------------------------------------------------
# Parameter counting helpers (nn.Linear, transformers' Conv1D and nn.LayerNorm conventions)
# ---------------------------------------------------------------------------------------------

def linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def layernorm(h: int, affine: bool = True, bias: bool = True) -> int:
    return (h + (h if bias else 0)) if affine else 0


def qkvo(h: int, q_dim: int, kv_dim: int, qkv_bias: bool, o_bias: bool) -> int:
    """Separate or fused q/k/v projections plus the output projection: fusing changes no count."""
    return linear(h, q_dim + 2 * kv_dim, qkv_bias) + linear(q_dim, h, o_bias)


def mlp(h: int, f: int, bias: bool, gated: bool) -> int:
    """Up (and gate) h->f, down f->h; gate and up share one bias pattern."""
    return (2 if gated else 1) * linear(h, f, bias) + linear(f, h, bias)


def normalise_activation(name: str) -> str:
    """HF activation names -> the spec's vocabulary (same math, same autograd storage)."""
    name = name.strip().lower()
    return {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python": "gelu"}.get(name, name)


def head(tied: bool, n_in: int, vocab: int, bias: bool = False) -> int:
    """An untied output projection; a tied one shares the embedding weight (counted once there)."""
    return 0 if tied else linear(n_in, vocab, bias)

