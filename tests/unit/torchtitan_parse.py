"""Parse override sets with torchtitan 0.3's own ConfigManager.parse_args, in a process of its own (torchtitan's
imports set allocator variables and warnings filters that must not leak into the test session).

stdin: one request a line, a JSON list of [module, config, [args...]]; stdout: one line per request, REPLY and a
JSON list, one entry per set, either {"error": "<tyro's message, last lines>"} or the resolved fields fsdp-plan
plans. parse() is the tests' side: one process per test process (an xdist worker), started on the first request
and kept for the others, so torchtitan's imports (~5 s of CPU: torch, the model modules) are paid once for every
test file that parses (tests/unit/test_emit_mesh.py, tests/cli/test_pipeline_cli.py, tests/doctor/*_round_trip.py)
rather than once per file.

torchtitan 0.3.0 imports triton at module level for its async expert-parallel kernels
(torchtitan/distributed/minimal_async_ep/kernels.py); a CPU torch has no triton, and parsing a config never runs
those kernels, so when triton is absent that one module is stood in by one that raises if a kernel is called.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import io
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import types

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _stand_in_for_triton_kernels() -> None:
    if importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(KERNELS)

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{KERNELS}.{name}: triton is not installed")

        return kernel

    stub.__getattr__ = __getattr__
    sys.modules[KERNELS] = stub


def resolved(c) -> dict:
    ac = c.activation_checkpoint
    return {
        "dp_replicate": c.parallelism.data_parallel_replicate_degree,
        "dp_shard": c.parallelism.data_parallel_shard_degree,
        "reshard": c.parallelism.fsdp_reshard_after_forward,
        "tp": c.parallelism.tensor_parallel_degree, "cp": c.parallelism.context_parallel_degree,
        "ep": c.parallelism.expert_parallel_degree, "pp": c.parallelism.pipeline_parallel_degree,
        "pp_schedule": c.parallelism.pipeline_parallel_schedule,
        "pp_microbatch_size": c.parallelism.pipeline_parallel_microbatch_size,
        "module_fqns_per_model_part": c.parallelism.module_fqns_per_model_part,
        "pp_first_stage_less_layers": c.parallelism.pipeline_parallel_first_stage_less_layers,
        "pp_last_stage_less_layers": c.parallelism.pipeline_parallel_last_stage_less_layers,
        "pp_layers_per_stage": c.parallelism.pipeline_parallel_layers_per_stage,
        "disable_cuda_graphs": c.training.disable_cuda_graphs,
        "sequence_parallel": c.parallelism.enable_sequence_parallel,
        "async_tp": c.compile.enable_async_tensor_parallel,
        "compile": c.compile.enable, "components": list(c.compile.components),
        "ac": "none" if ac is None else type(ac).__qualname__.split(".")[0],
        "local_batch_size": c.training.local_batch_size, "global_batch_size": c.training.global_batch_size,
        "seq_len": c.training.seq_len, "dtype": c.training.dtype,
        "mixed_precision_param": c.training.mixed_precision_param, "offload": c.training.enable_cpu_offload,
        "loss": type(c.loss).__qualname__.split(".")[0], "loss_chunks": getattr(c.loss, "num_chunks", None),
        "optimizer_impl": c.optimizer.implementation,
        "checkpoint": [c.checkpoint.enable, c.checkpoint.folder, c.checkpoint.interval, c.checkpoint.async_mode],
    }


FLOAT8_FUNCTION = "<float8 config function>"  # an entry [FLOAT8_FUNCTION, its code, [its name]]


def float8_function(code: str, name: str) -> dict:
    """Run the Float8 config function --emit torchtitan writes, with its module's model_registry building the
    flavor without converters (Float8LinearConverter.build needs torchao and an FP8 GPU): the flavor must be one
    torchtitan knows, the converter configs must construct."""
    namespace: dict = {}
    exec(compile(code, "<float8 config function>", "exec"), namespace)
    real = namespace["model_registry"]
    seen = {}

    def model_registry(flavor, converters=None, **kwargs):
        seen["converters"] = converters
        return real(flavor, **kwargs)

    namespace["model_registry"] = model_registry
    config = namespace[name]()
    converter = seen["converters"][0]
    return {"model": config.model_spec.name, "flavor": config.model_spec.flavor,
            "converter": type(converter).__qualname__, "filter_fqns": list(converter.filter_fqns),
            "model_compile_enabled": converter.model_compile_enabled}


REPLY = "REPLY "  # a reply line's start: anything else a library prints on stdout is skipped


def main() -> None:
    _stand_in_for_triton_kernels()
    for request in sys.stdin:
        if request.strip():
            print(REPLY + json.dumps(parse_sets(json.loads(request))), flush=True)


def parse_sets(sets: list) -> list:
    from torchtitan.config import ConfigManager

    out = []
    for module, config, args in sets:
        if module == FLOAT8_FUNCTION:
            out.append(float8_function(config, args[0]))
            continue
        text = io.StringIO()
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                c = ConfigManager().parse_args(["--module", module, "--config", config, *args])
            out.append(resolved(c))
        except SystemExit:  # tyro prints why and exits 2
            lines = [line.strip(" │╭╮╰╯─") for line in text.getvalue().splitlines()]
            start = next((i for i, line in enumerate(lines) if line.startswith("Unrecognized options:")), None)
            if start is None:
                out.append({"error": " ".join(line for line in lines if line)[:300]})
                continue
            said = []  # tyro wraps a long option onto the next line: up to the blank line after it
            for line in lines[start:]:
                if said and (not line or line.startswith("---")):
                    break
                said.append(line)
            out.append({"error": "".join(said).replace(":", ": ", 1).replace(":  ", ": ")})
    return out


class _Parser:
    """This file run as a process of its own, kept for the test process's later requests."""

    def __init__(self):
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr)
        self.pending = b""
        atexit.register(self.close)

    def parse(self, sets: list, timeout_s: float) -> list:
        self.proc.stdin.write(json.dumps(sets).encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            line, newline, rest = self.pending.partition(b"\n")
            if newline:
                self.pending = rest
                if line.startswith(REPLY.encode()):
                    return json.loads(line[len(REPLY):])
                continue
            ready = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16) if ready else b""
            if not chunk:  # timed out, or the parser exited
                self.close()
                self.stderr.seek(0)
                raise AssertionError(f"torchtitan's parser {'timed out' if not ready else 'exited'}: "
                                     f"{self.stderr.read().decode(errors='replace')[-2000:]}")
            self.pending += chunk

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_PARSER: list[_Parser] = []


def parse(sets: list, timeout_s: float = 600) -> list[dict]:
    """Each [module, config, [args...]] of `sets` through torchtitan's ConfigManager.parse_args, in the parser
    process this test process keeps (started on the first call; a new one after a failure)."""
    if not _PARSER or _PARSER[0].proc.poll() is not None:
        _PARSER[:] = [_Parser()]
    return _PARSER[0].parse([list(s) for s in sets], timeout_s)


if __name__ == "__main__":
    main()
