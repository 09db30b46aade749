"""OMP_NUM_THREADS on the launch lines (planner/emit/common.py cpu_step_threads): a plan whose optimizer step runs
on the host (CPU offload) is priced with --omp-num-threads N a rank (cost_models/host_optimizer.py), so every dialect
that writes a launch line or environment sets N where its launcher would give the ranks another count - torchrun 1
with several processes a node and none with one (torch/distributed/run.py), accelerate launch 1, Lightning cpus /
processes - and nothing where no step runs on the CPU or the launcher's count is the priced one. One estimate of
llama3.2-1b on 8 GPUs (~1 s), its cluster and offload changed by replace()."""

import dataclasses

import pytest

from planner.api import estimate
from planner.emit import emit_artifact
from planner.hardware import make_cluster

# the dialects that launch or describe a launch, and the text each carries for 8 threads a rank
CARRIED = {"torchrun": "OMP_NUM_THREADS=8 torchrun ", "slurm": "\nexport OMP_NUM_THREADS=8\n",
           "pytorchjob": "- name: OMP_NUM_THREADS\n              value: '8'\n",
           "hf-trainer": "OMP_NUM_THREADS=8 torchrun ", "torchtitan": "launch: OMP_NUM_THREADS=8 torchrun ",
           "axolotl": "run with: OMP_NUM_THREADS=8 torchrun ",
           "automodel": "run with: OMP_NUM_THREADS=8 automodel recipe.yaml",
           "accelerate": "# launch: OMP_NUM_THREADS=8 accelerate launch --config_file",
           "lightning": "# launch: OMP_NUM_THREADS=8 python train.py"}


@pytest.fixture(scope="module")
def offloaded():
    return estimate("llama3.2-1b", 8, offload=True, omp_num_threads=8, sharding="FULL_SHARD")


def _with(c, offload=True, threads=8, gpus_per_node=8):
    cluster = make_cluster(8, gpus_per_node=gpus_per_node, omp_num_threads=threads)
    config = dataclasses.replace(c.config, offload=offload)
    return dataclasses.replace(c, cluster=cluster, evaluation=dataclasses.replace(c.evaluation, config=config))


def test_a_cpu_step_at_8_threads_is_on_every_launch(offloaded):
    assert offloaded.config.offload and offloaded.cluster.host_cpu.threads_per_rank == 8
    for kind, text in CARRIED.items():
        assert text in emit_artifact(kind, offloaded), kind
    from planner.emit import recommendation_text

    assert "OMP_NUM_THREADS=8 torchrun " in recommendation_text(offloaded)


def test_nothing_where_no_step_runs_on_the_cpu_or_the_launcher_gives_the_priced_count(offloaded):
    on_gpu = _with(offloaded, offload=False)   # the step on the GPU: the threads price nothing
    one = _with(offloaded, threads=1)          # torchrun's, accelerate's 1 with 8 processes a node
    for kind in CARRIED:
        assert "OMP_NUM_THREADS" not in emit_artifact(kind, on_gpu), kind
        if kind != "lightning":
            assert "OMP_NUM_THREADS" not in emit_artifact(kind, one), kind
    # Lightning sets cpus / processes where it is unset: the priced 1 is written
    assert "# launch: OMP_NUM_THREADS=1 python train.py" in emit_artifact("lightning", one)


def test_one_process_a_node_gets_the_priced_1_from_torchrun_lines(offloaded):
    """With one process a node torchrun leaves OMP_NUM_THREADS unset (torch then runs a thread per core): the
    priced 1 is written there, and accelerate (its own default 1) writes none."""
    single = _with(offloaded, threads=1, gpus_per_node=1)
    assert single.cluster.n_nodes == 8
    assert "OMP_NUM_THREADS=1 torchrun --nnodes 8 --nproc_per_node 1 " in emit_artifact("torchrun", single)
    assert "\nexport OMP_NUM_THREADS=1\n" in emit_artifact("slurm", single)
    assert "OMP_NUM_THREADS" not in emit_artifact("accelerate", single)
