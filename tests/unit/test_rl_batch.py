"""verl's batch arithmetic (cost_models/rl_batch.py), each figure worked by hand beside it."""

import dataclasses

import pytest

from cost_models.rl_batch import RlBatch, batch_plan
from cost_models.specs import SpecError


def test_golden_case_1_batch():
    # verl's 2 x H800 Qwen2-7B GRPO: 1024 prompts x n 5 = 5120 sequences; mini 256 x 5 / 2 ranks = 640 per rank;
    # micro 16: 40 micro-batches; 4 mini-batches; padded maxima 1024 + 1024: 16 x 2048 = 32,768 tokens
    b = RlBatch(train_batch_size=1024, rollout_n=5, ppo_mini_batch_size=256, max_prompt_length=1024,
                max_response_length=1024, ppo_micro_batch_size_per_gpu=16, log_prob_micro_batch_size_per_gpu=16)
    p = batch_plan(b, n_gpus=2, heads=28, kv_heads=4, rollout_tp=2)
    assert (p.data_parallel, p.sequences_per_step, p.mini_batches_per_step) == (2, 5120, 4)
    assert (p.mini_batch_seqs_per_rank, p.micro_batches_per_mini) == (640, 40)
    assert p.update_tokens_per_gpu == p.log_prob_tokens_per_gpu == 32_768
    assert p.step_seqs_per_rank == 2560 and p.rollout_seqs_per_replica == 5120  # TP 2 on 2 GPUs: one replica
    assert p.refusals == ()


def test_remove_padding_and_ulysses_split_the_tokens():
    # mean lengths 200 + 300 = 500 tokens a sequence; 8 per micro-batch = 4,000 over Ulysses 2: 2,000 per GPU
    b = RlBatch(train_batch_size=64, rollout_n=4, ppo_mini_batch_size=32, max_prompt_length=512,
                max_response_length=1024, ppo_micro_batch_size_per_gpu=8, ulysses_sequence_parallel_size=2,
                mean_prompt_length=200, mean_response_length=300)
    p = batch_plan(b, n_gpus=4, heads=28, kv_heads=4, rollout_tp=2)
    assert p.data_parallel == 2 and p.mini_batch_seqs_per_rank == 64  # 32 x 4 / 2
    assert p.update_tokens_per_gpu == 2_000


def test_dynamic_budget_is_per_gpu_times_ulysses():
    # budget 16,384 x sp 2 = 32,768 tokens over the group, 16,384 per GPU; capped by the rank's mini-batch
    # (64 sequences x 1,536 = 98,304 tokens: not binding)
    b = RlBatch(train_batch_size=64, rollout_n=4, ppo_mini_batch_size=32, max_prompt_length=512,
                max_response_length=1024, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=16_384,
                ulysses_sequence_parallel_size=2)
    p = batch_plan(b, 4, 28, 4, 2)
    assert p.update_tokens_per_gpu == 16_384
    # verl 0.9.1's count (rearrange_micro_batches): from ceil(98,304 / 32,768) = 3 it adds micro-batches until each
    # holds whole sequences within the budget: 32,768 // 1,536 = 21 sequences a micro-batch, ceil(64 / 21) = 4
    assert p.micro_batches_per_mini == 4
    # its time runs the real tokens, not the budget: 64 x 1,536 / 4 micro-batches / sp 2 = 12,288 per GPU; the
    # log-prob's: 128 sequences a rank, 21 a micro-batch -> 7, 128 x 1,536 / 7 / 2 = 14,043.4 -> 14,044
    assert (p.update_run_tokens_per_gpu, p.log_prob_run_tokens_per_gpu) == (12_288, 14_044)
    # a rank holding only 4 x 1,536 = 6,144 tokens packs them all: 3,072 per GPU
    small = RlBatch(train_batch_size=2, rollout_n=4, ppo_mini_batch_size=2, max_prompt_length=512,
                    max_response_length=1024, use_dynamic_bsz=True, ulysses_sequence_parallel_size=2)
    assert batch_plan(small, 4, 28, 4, 2).update_tokens_per_gpu == 3_072


def test_verls_asserts_become_refusals():
    b = RlBatch(train_batch_size=60, rollout_n=5, ppo_mini_batch_size=64, max_prompt_length=512,
                max_response_length=1024, ppo_micro_batch_size_per_gpu=7, use_dynamic_bsz=False,
                ulysses_sequence_parallel_size=3)
    codes = [r.code for r in batch_plan(b, n_gpus=8, heads=40, kv_heads=8, rollout_tp=3).refusals]
    # 3 divides neither 8 GPUs nor 40 heads nor 8 KV heads; 300 sequences % 8; 64 > 60; 3 does not divide 8 / 40
    assert codes == ["ulysses-gpus", "ulysses-heads", "ulysses-kv-heads", "batch-gpus", "mini-batch", "micro-batch",
                     "rollout-tp"]
    over = RlBatch(train_batch_size=8, rollout_n=2, ppo_mini_batch_size=8, max_prompt_length=1024,
                   max_response_length=4096, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=4096,
                   log_prob_max_token_len_per_gpu=8192)
    refused = batch_plan(over, 8, 28, 4, 1).refusals
    assert [(r.field, r.code) for r in refused] == [("ppo_max_token_len_per_gpu", "token-budget")]
    assert "4096 < prompt + response 5120" in refused[0].reason
    # verl's FSDP engine refuses Ulysses without remove-padding (workers/engine/fsdp/transformer_impl.py)
    padded = dataclasses.replace(over, ulysses_sequence_parallel_size=2, use_remove_padding=False)
    assert [(r.field, r.code) for r in batch_plan(padded, 8, 28, 4, 1).refusals][0] == (
        "use_remove_padding", "ulysses-remove-padding")
    assert not batch_plan(dataclasses.replace(padded, ulysses_sequence_parallel_size=1), 8, 28, 4, 1).refusals[1:]


def test_bad_lengths_name_the_field():
    with pytest.raises(SpecError, match="mean_response_length: must be in 1..1024"):
        RlBatch(train_batch_size=8, rollout_n=2, ppo_mini_batch_size=8, max_prompt_length=512,
                max_response_length=1024, mean_response_length=2000)
