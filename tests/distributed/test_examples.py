"""The runnable examples: plan a model; apply the planner's pick with the Python API under torchrun."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_plan_a_model_example():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "plan_a_model.py")], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "llama3-8b: 8,030,261,248 parameters" in r.stdout and "fully_shard(" in r.stdout


def test_lora_finetune_example():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "lora_finetune.py")], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    full, lora = (line for line in r.stdout.splitlines() if line.startswith(("full:", "lora:")))
    # LoRA keeps grads and Adam state for the adapters only: a small fraction of full fine-tuning's (the
    # frozen weights may be sharded or not: at 8 GPUs the planner may keep them whole, NO_SHARD)
    trained = [float(line.split("grads + optimizer ")[1].split(",")[0]) for line in (full, lora)]
    assert trained[1] < 0.05 * trained[0], trained
    assert "CustomPolicy(lora_unit)" in r.stdout and "cast_forward_inputs=True" in r.stdout


@pytest.mark.distributed
@pytest.mark.parametrize("version", [1, 2])
def test_train_with_plan_under_torchrun(version):
    # p.best.fsdp_kwargs(model) (FSDP1) / p.best.apply_fully_shard(model) (FSDP2): 2 ranks, gloo, CPU.
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(ROOT / "examples" / "train_with_plan.py"), "--fsdp-version", str(version)],
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    losses = result["losses"]
    assert result["fsdp_version"] == version and len(losses) == 8
    assert losses[-1] < 0.95 * losses[0], losses  # AdamW on a fixed batch: the loss falls
