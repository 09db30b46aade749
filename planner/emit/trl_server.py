"""The `trl vllm-serve` launch line of TRL's vllm_mode="server" (trl/scripts/vllm_serve.py: ScriptArguments'
flags, underscores or dashes as HfArgumentParser takes them; the flags it does not declare go to `vllm serve` as
they are): --emit trl writes it as a comment of the GRPOConfig's YAML, fsdp-plan check reads it back
(planner/doctor/readers/trl_grpo.py). A GRPOConfig holds none of the server's knobs (vllm_tensor_parallel_size and
vllm_gpu_memory_utilization are colocate mode's)."""

from __future__ import annotations

import re
import shlex

from planner.emit.rl_flags import typed

SERVE = re.compile(r"^\s*#.*?\b(?:trl\s+vllm-serve|vllm\s+serve)\b(.*)$", re.M)
# the line's flags -> the request's fields: ScriptArguments' own, then vllm serve's (passed through)
FLAGS = {"tensor_parallel_size": "rollout_tp", "data_parallel_size": "vllm_server_data_parallel_size",
         "gpu_memory_utilization": "gpu_memory_utilization", "enforce_eager": "enforce_eager",
         "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens"}
# ScriptArguments' defaults, where the line leaves them out
DEFAULTS = {"rollout_tp": 1, "vllm_server_data_parallel_size": 1, "gpu_memory_utilization": 0.9}
_BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")


def serve_line(r) -> str:
    """The server's launch line for request r: its TP, DP, utilization and length, and the vllm serve flags priced
    (max_num_seqs, max_num_batched_tokens, enforce_eager) explicitly: vllm serve's own defaults depend on the GPU."""
    words = ["trl", "vllm-serve", "--model", str(r.model), "--tensor-parallel-size", str(r.rollout_tp),
             "--data-parallel-size", str(r.vllm_server_data_parallel_size or 1), "--gpu-memory-utilization",
             str(r.gpu_memory_utilization), "--max-model-len", str(r.prompt_len + r.response_len), "--max-num-seqs",
             str(r.max_num_seqs), "--max-num-batched-tokens", str(r.max_num_batched_tokens)]
    return shlex.join(words + (["--enforce-eager"] if r.enforce_eager else []))


def read_serve_line(text: str) -> dict | None:
    """The request fields of a commented `trl vllm-serve` (or `vllm serve`) line in `text`, its defaults for what it
    leaves out; None without one."""
    found = SERVE.search(text)
    if found is None:
        return None
    tokens, out = shlex.split(found.group(1)), dict(DEFAULTS)
    while tokens:
        word = tokens.pop(0)
        if not word.startswith("--"):
            continue
        flag, _, value = word[2:].partition("=")
        field = FLAGS.get(flag.replace("-", "_"))
        if not value and tokens and not tokens[0].startswith("--") and (
                field != "enforce_eager" or tokens[0].lower() in _BOOL_WORDS):
            value = tokens.pop(0)
        if field is not None:
            out[field] = typed(field, value or "true", f"trl vllm-serve --{flag}")
    return out
