"""`fsdp-plan explain --trainer`: a configuration explained as `fsdp-plan estimate --trainer` prices it (the
trainer's allocator settings, kernels and loss), not as the planner's own FSDP2 code runs it."""

from __future__ import annotations

from test_float_flags import invoke  # (exit code, stdout, stderr) of `fsdp-plan ARGV` (tests/cli is on sys.path)

ARGS = ["explain", "--model", "llama3.2-1b", "--gpus", "8", "--gpu", "h100-80gb", "--micro-batch", "1",
        "--seq-len", "2048"]


def test_explain_takes_the_trainer(capsys):
    code, out, err = invoke(ARGS, capsys)
    assert code == 0, err
    assert "replayed through the caching allocator under PyTorch's default settings" in out
    code, out, err = invoke([*ARGS, "--trainer", "torchtitan"], capsys)
    assert code == 0, err
    # torchtitan's run_train.sh exports it (planner/trainers/table.py)
    assert "replayed through the caching allocator under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
    code, out, err = invoke([*ARGS, "--trainer", "nope"], capsys)
    assert code == 2 and err.strip().startswith("error: trainer: unknown trainer 'nope'; choose one of: fsdp2")


def test_explain_names_torchtitan_edge_units(capsys):
    """torchtitan 0.3 wraps the embedding and [final norm, head] as units of their own (cost_models/edge_units.py):
    explain's gathered parameters and gradients say so for an untied model, and the root layout otherwise."""
    args = ["explain", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--micro-batch", "1",
            "--seq-len", "2048"]
    code, out, err = invoke([*args, "--trainer", "torchtitan"], capsys)
    assert code == 0, err
    assert "torchtitan 0.3's edge units: the embedding resharded after forward" in out
    assert "edge units: the head unit's reduced after its own backward, the embedding's at the end of backward" in out
    code, out, err = invoke(args, capsys)
    assert code == 0, err
    assert "the root's and the current block's gradients before reduce-scatter" in out
    assert "edge units" not in out
