"""`fsdp-plan check` on Python: the planner's own snippets (--emit fsdp2: fully_shard with its mesh, TP, CP, EP and
pipeline; --emit fsdp1: FullyShardedDataParallel; --emit lightning: Lightning's FSDPStrategy) and a user's script
written the same way, read with `ast` and never run (planner/doctor/readers/python_ast.py). The forms' own readers:
python_fsdp.py (fsdp2, fsdp1) and python_lightning.py, on what python_shared.py reads for all of them (the
vocabulary, precision, checkpointing, compile, Float8, Liger, the optimizer).

What a snippet does not say is not invented: the micro-batch and the accumulation of a non-pipelined snippet are
the training loop's (comments only), so check takes them from --micro-batch / --grad-accum (default 1), as for an
accelerate config; a pipeline's MICROBATCH_SIZE and N_MICROBATCHES are code and are read.
"""

from __future__ import annotations

import ast
import dataclasses

from planner.doctor.readers import python_fsdp, python_lightning, python_qlora
from planner.doctor.readers.python_ast import Snippet, dotted
from planner.doctor.readers.python_shared import WRAPPERS, called, check_vocabulary
from planner.errors import PlannerError


def is_python_code(text: str, suffix: str) -> bool:
    """A .py file, or text that parses as Python and calls fully_shard / FullyShardedDataParallel / FSDPStrategy."""
    if suffix == ".py":
        return True
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return any(isinstance(n, ast.Call) and (dotted(n.func) or "").rpartition(".")[2] in WRAPPERS + ("FSDP",)
               for n in ast.walk(tree))


def from_python(text: str, source: str = "python"):
    """The UserSetup of a snippet: Lightning's FSDPStrategy, FSDP2's fully_shard, or FSDP1's wrapper."""
    snippet = Snippet(text, source)
    check_vocabulary(snippet)
    if called(snippet, "FSDPStrategy"):
        setup = python_lightning.from_lightning(snippet)
    elif called(snippet, "fully_shard"):
        setup = python_fsdp.from_fsdp2(snippet)
    elif called(snippet, "FullyShardedDataParallel"):
        setup = python_fsdp.from_fsdp1(snippet)
    else:
        setup = None
    if setup is not None:  # a QLoRA base the script loads (BitsAndBytesConfig): for rules_qlora; peft's targets
        qlora, knobs = python_qlora.read_qlora(snippet)
        targets, notes = python_qlora.read_lora_config(snippet)
        return dataclasses.replace(setup, qlora=qlora or setup.qlora, training=setup.training + knobs + targets,
                                   notes=setup.notes + notes)
    raise PlannerError("config", f"{source} calls none of fully_shard, FullyShardedDataParallel (FSDP), "
                                 "FSDPStrategy: fsdp-plan check reads the code of --emit fsdp2, fsdp1 or lightning")
