"""Units, converted once at the edges. Bytes are integers everywhere inside the models."""

from __future__ import annotations

import re

KiB = 1024
MiB = 1024**2
GiB = 1024**3
GB = 10**9
TB = 10**12
TFLOP = 10**12

# Element widths in bytes.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "bool": 1}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_FACTORS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    """Parse '80GiB', '80 GB', '1.5TiB' or a plain byte count into bytes."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 80GiB, 40GB, 1073741824)")
    number, unit = m.groups()
    return int(float(number) * _SIZE_FACTORS[(unit or "B").lower()])


def gbit_per_s_to_bytes_per_s(gbit_per_s: float) -> float:
    return gbit_per_s * 1e9 / 8


def fmt_gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.2f}"
