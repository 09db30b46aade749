"""What the pipeline torchrun tests share (test_torchrun_pp.py: 2 ranks, test_torchrun_pp_dp.py: 4): the tiny
model, its cases, the trace of a case and the two comparisons; test_torchrun_pp.py's docstring gives the figures."""

from __future__ import annotations

import functools
import json

import pytest

TIMEOUT_S = 300
REAL_RUN_JITTER_BYTES = 65_536      # one real run's peak against a fixed figure, by hash seed (test_torchrun_ep)
SEQ_LEN, HIDDEN = 64, 64
TINY = dict(model_type="llama", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)


def cases(**config) -> list[dict]:
    """GPipe and 1F1B of the tiny model with these FsdpConfig fields (fp32, pp 2 by default)."""
    return [{"hf_config": TINY, "config": {"pp": 2, "precision": "fp32", **config, "pp_schedule": schedule},
             "seq_len": SEQ_LEN} for schedule in ("gpipe", "1f1b")]


@functools.cache
def traced(config_json: str, world: int, seq_len: int = SEQ_LEN):
    from calibration.trace_pipeline import trace_pipeline
    from planner.models import from_hf_config
    from tests.distributed.cases import config_from_dict

    spec = from_hf_config(dict(TINY), name="tiny-pp")
    return trace_pipeline(spec, config_from_dict(json.loads(config_json)), n_gpus=world, gpus_per_node=world,
                          seq_len=seq_len, hf_config=dict(TINY))


def traced_case(case: dict, world: int):
    """The case's trace (one TraceResult per pipeline rank), cached."""
    return traced(json.dumps(case["config"], sort_keys=True), world, case.get("seq_len", SEQ_LEN))


def trace_cases(cases: list[dict], world: int) -> None:
    """Each case's trace into traced's cache (cases.shared's while_launching: while the real runs run)."""
    for case in cases:
        traced_case(case, world)


def check_against_trace(real: dict, case: dict, world: int) -> None:
    """Every global rank's real peak against its pipeline rank's traced one: the trace's, plus at most one stage
    output that gloo keeps after its send (test_torchrun_pp.py), within the real runs' jitter; the same peak
    phase; the counted states to the byte. The trace is of the pipeline rank's first CP rank, whose ring steps
    update half their queries (the merge's torch.cat: the larger transients); another CP rank's peak may only be
    lower, and its peak phase is not fixed: pp 2 x cp 2's CP rank 1 peaked in the forward in one run (3,909,260 B)
    and in the backward in others (the suite's run at f274cd3 failed on it), so the phase is checked on CP rank 0
    (a forward allowed where the real peak holds gloo's kept send: below)."""
    trace = traced_case(case, world)
    config = case["config"]
    shards = config.get("cp", 1) * (config.get("tp", 1) if config.get("sequence_parallel", True) else 1)
    sent_bytes = config.get("micro_batch", 1) * case.get("seq_len", SEQ_LEN) // shards * HIDDEN * 4  # a stage output
    for rank in real["ranks"]:
        t = trace[rank["pp_rank"]]
        extra = rank["peak_allocated_bytes"] - t.peak_allocated_bytes
        below = float("inf") if rank.get("cp_rank", 0) else REAL_RUN_JITTER_BYTES
        assert -below <= extra <= sent_bytes + REAL_RUN_JITTER_BYTES, (
            rank["rank"], rank["peak_allocated_bytes"], t.peak_allocated_bytes, rank["phases"], t.to_dict()["phases"])
        # another CP rank's lower transients may leave its peak in another phase; and where the real peak holds the
        # stage output gloo keeps after its send (extra of about sent_bytes), that output can lift a forward peak
        # above the trace's backward one (pp 2 x cp 2 rank 0 at 1a20401: forward 4,040,332 B = the trace's backward
        # 4,007,564 + 32,768, one output): then the forward is the other phase allowed
        phases = {t.peak_phase} | ({"forward"} if extra > sent_bytes // 2 else set())
        if not rank.get("cp_rank", 0):
            assert rank["peak_phase"] in phases, (rank["rank"], rank["peak_phase"], t.peak_phase,
                                                  rank["phases"], t.to_dict()["phases"])
        counted = rank["phases"]["optimizer_step"]["breakdown"]
        for key in ("sharded_params", "sharded_grads", "optimizer_state"):  # counted, not timed: to the byte
            assert counted[key] == t.phases["optimizer_step"].breakdown[key], key


def check_estimate(case: dict, world: int, rel: float) -> None:
    """The estimate's peak of each pipeline rank (cost_models/pipeline_memory.py, no torch) within `rel` of the
    case's trace."""
    from cost_models.memory import estimate_memory
    from cost_models.profile import DEFAULT_PROFILE
    from planner.api import resolve_inputs
    from tests.distributed.cases import config_from_dict

    spec, cluster, training = resolve_inputs(dict(TINY), world, gpus_per_node=world,
                                             seq_len=case.get("seq_len", SEQ_LEN))
    ranks = estimate_memory(spec, cluster, training, config_from_dict(case["config"]), DEFAULT_PROFILE).pipeline_ranks
    for rank, trace in zip(ranks, traced_case(case, world), strict=True):
        assert rank.peak_allocated_bytes == pytest.approx(trace.peak_allocated_bytes, rel=rel), rank.rank


def check_numerics(real: dict) -> None:
    """The pipeline's loss equals the unsplit model's at each of 3 steps to 1e-5, every gradient to 1e-6."""
    assert real["losses"] == pytest.approx(real["reference_losses"], abs=1e-5)
    assert real["losses"][0] > real["losses"][-1]  # it trains
    assert real["max_grad_error"] <= 1e-6 and real["max_grad"] > 1e-3, real
