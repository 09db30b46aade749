"""verl's batch arithmetic for a GRPO / PPO step with FSDP workers: sequences per rank, micro-batches and the
tokens one GPU's forward holds, with the checks verl asserts (as typed refusals, not exceptions).

Read from verl (verl-project/verl, 2025; shared/reference/rl.md): workers/fsdp_workers.py ActorRolloutRefWorker
normalises ppo_mini_batch_size (prompts) x rollout.n // (world / ulysses) and asserts it divides by
ppo_micro_batch_size_per_gpu; trainer/ppo/ray_trainer.py _validate_config asserts train_batch x n divides by the
GPUs and train_batch >= ppo_mini_batch_size; utils/seqlen_balancing.py rearrange_micro_batches packs a dynamic
micro-batch to max_token_len = ppo_max_token_len_per_gpu x ulysses and asserts it holds the longest sequence;
models/transformers/monkey_patch.py asserts the Ulysses degree divides the heads (KV heads: divides or is a
multiple of them). With use_remove_padding the forward holds the real lengths (mean_*_len), else the padded ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from .feasibility import Refusal
from .spec_values import SpecError, check_positive


@dataclass(frozen=True)
class RlBatch:
    """The batch knobs as verl names them; lengths in tokens (max_*: the padded maxima, mean_*: the data's)."""

    train_batch_size: int               # data.train_batch_size: prompts per step
    rollout_n: int                      # rollout.n: responses per prompt
    ppo_mini_batch_size: int            # prompts per optimizer step
    max_prompt_length: int
    max_response_length: int
    ppo_micro_batch_size_per_gpu: int = 1   # sequences per update micro-batch (static batches)
    log_prob_micro_batch_size_per_gpu: int = 1
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    log_prob_max_token_len_per_gpu: int = 16384
    ulysses_sequence_parallel_size: int = 1
    use_remove_padding: bool = True
    mean_prompt_length: int | None = None   # None: the maxima (the worst case)
    mean_response_length: int | None = None

    def __post_init__(self):
        for name in ("train_batch_size", "rollout_n", "ppo_mini_batch_size", "max_prompt_length",
                     "max_response_length", "ppo_micro_batch_size_per_gpu", "log_prob_micro_batch_size_per_gpu",
                     "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", "ulysses_sequence_parallel_size"):
            check_positive(name, getattr(self, name))
        for name, cap in (("mean_prompt_length", self.max_prompt_length),
                          ("mean_response_length", self.max_response_length)):
            value = getattr(self, name)
            if value is not None and not 0 < value <= cap:
                raise SpecError(name, f"must be in 1..{cap} (the maximum), got {value}")

    @property
    def max_seq_len(self) -> int:
        return self.max_prompt_length + self.max_response_length

    @property
    def seq_tokens(self) -> int:
        """Tokens one sequence occupies in the forward: the real mean with remove-padding, else the padded max."""
        return self.seq_prompt_tokens + self.seq_response_tokens

    @property
    def seq_prompt_tokens(self) -> int:
        return self.mean_prompt_length or self.max_prompt_length if self.use_remove_padding else self.max_prompt_length

    @property
    def seq_response_tokens(self) -> int:
        return (self.mean_response_length or self.max_response_length if self.use_remove_padding
                else self.max_response_length)


@dataclass(frozen=True)
class BatchPlan:
    data_parallel: int              # GPUs / Ulysses
    sequences_per_step: int         # train_batch x n
    mini_batches_per_step: int
    mini_batch_seqs_per_rank: int   # verl's normalised ppo_mini_batch_size
    micro_batches_per_mini: int
    update_tokens_per_gpu: int      # one update micro-batch's tokens on one GPU (after Ulysses' split): its memory
    log_prob_tokens_per_gpu: int
    step_seqs_per_rank: int         # sequences per data-parallel rank per step (what log-probs run over)
    rollout_seqs_per_replica: int   # sequences one engine replica (rollout TP GPUs) generates
    refusals: tuple[Refusal, ...] = ()
    # the tokens a micro-batch runs on average (its time): static, as held; dynamic, the rank's real tokens over
    # rearrange_micro_batches' count (a balanced partition, not filled to the budget); 0: as held
    update_run_tokens_per_gpu: int = 0
    log_prob_run_tokens_per_gpu: int = 0
    ulysses: int = 1                # ulysses_sequence_parallel_size (rl_ulysses.py)
    seq_tokens: int = 0             # one sequence's tokens as the forward holds it (RlBatch.seq_tokens)
    response_tokens: int = 0        # of which the response's: what TRL's fused head scores (rl_trl_head.py)

    def scored_tokens(self, tokens: int) -> int:
        """The response tokens among `tokens` of whole sequences (every token where unknown)."""
        return tokens * self.response_tokens // self.seq_tokens if self.seq_tokens else tokens


def _ulysses_refusals(sp: int, n_gpus: int, heads: int, kv_heads: int, remove_padding: bool) -> list[Refusal]:
    out = []
    if sp > 1 and not remove_padding:   # verl workers/engine/fsdp/transformer_impl.py raises ValueError at build
        out.append(Refusal("use_remove_padding", "ulysses-remove-padding", f"Ulysses {sp} needs it (verl raises "
                           "'you must enable use_remove_padding')", "set model.use_remove_padding=True"))
    if n_gpus % sp:
        out.append(Refusal("ulysses_sequence_parallel_size", "ulysses-gpus", f"{sp} does not divide the {n_gpus} GPUs",
                           "choose a divisor of the GPU count"))
    if heads % sp:
        out.append(Refusal("ulysses_sequence_parallel_size", "ulysses-heads", f"num_attention_heads {heads} must be "
                           f"divisible by ulysses_sp_size {sp}", "choose a Ulysses degree dividing the heads"))
    if kv_heads % sp and sp % kv_heads:
        out.append(Refusal("ulysses_sequence_parallel_size", "ulysses-kv-heads", f"num_key_value_heads {kv_heads} and "
                           f"ulysses_sp_size {sp}: neither divides the other", "choose a divisor or multiple of the "
                           "KV heads"))
    return out


def _budget_refusal(name: str, budget: int, longest: int) -> list[Refusal]:
    if budget >= longest:
        return []
    return [Refusal(name, "token-budget", f"max_token_len must be greater than the sequence length: {budget} < "
                    f"prompt + response {longest}", f"raise {name} to >= {longest}")]


def _micro_tokens(dynamic: bool, micro_seqs: int, budget: int, seqs_per_rank: int, b: RlBatch, sp: int) -> int:
    """A micro-batch's tokens on one GPU: dynamic packs up to budget x sp over the Ulysses group (never more than
    the rank's sequences hold); static holds micro_seqs sequences. Ulysses splits them over sp GPUs."""
    tokens = min(budget * sp, seqs_per_rank * b.seq_tokens) if dynamic else min(micro_seqs, seqs_per_rank) \
        * b.seq_tokens
    return -(-tokens // sp)


def batch_plan(b: RlBatch, n_gpus: int, heads: int, kv_heads: int, rollout_tp: int, several_generations: bool = False,
               engine_gpus: int | None = None) -> BatchPlan:
    """The per-rank batch of one step (one train batch: a generation) and the refusals verl (or vLLM, for the rollout
    TP) would raise. several_generations (TRL): a train batch below the mini-batch is TRL's steps_per_generation
    below gradient_accumulation_steps, several generations per optimizer step (rl_schedule.trl_cycle), not verl's
    refusal. engine_gpus: the GPUs the engine runs on, where not the trainer's (TRL's vLLM server: TP x DP)."""
    sp = b.ulysses_sequence_parallel_size
    dp = max(1, n_gpus // sp)
    refusals = _ulysses_refusals(sp, n_gpus, heads, kv_heads, b.use_remove_padding)
    seqs = b.train_batch_size * b.rollout_n
    if seqs % n_gpus:
        refusals.append(Refusal("train_batch", "batch-gpus", f"real_train_batch_size ({seqs}) must be divisible by "
                                f"minimal possible batch size ({n_gpus})", "make train batch x rollout n a multiple "
                                "of the GPUs"))
    if b.train_batch_size < b.ppo_mini_batch_size and not several_generations:
        refusals.append(Refusal("ppo_mini_batch_size", "mini-batch", f"{b.ppo_mini_batch_size} > train batch "
                                f"{b.train_batch_size}", "choose a mini-batch <= the train batch"))
    mini = b.ppo_mini_batch_size * b.rollout_n // dp
    micro = b.ppo_micro_batch_size_per_gpu
    if mini == 0:
        refusals.append(Refusal("ppo_mini_batch_size", "mini-batch", f"{b.ppo_mini_batch_size} x n {b.rollout_n} "
                                f"// {dp} data-parallel ranks is 0", "raise the mini-batch"))
    elif not b.use_dynamic_bsz and mini % micro:
        refusals.append(Refusal("ppo_micro_batch_size_per_gpu", "micro-batch", f"normalized ppo_mini_batch_size "
                                f"{mini} should be divisible by ppo_micro_batch_size_per_gpu {micro}",
                                f"choose a divisor of {mini}"))
    if b.use_dynamic_bsz:
        refusals += _budget_refusal("ppo_max_token_len_per_gpu", b.ppo_max_token_len_per_gpu * sp, b.max_seq_len)
        refusals += _budget_refusal("log_prob_max_token_len_per_gpu", b.log_prob_max_token_len_per_gpu * sp,
                                    b.max_seq_len)
    engine_gpus = engine_gpus or n_gpus
    if engine_gpus % rollout_tp or heads % rollout_tp:
        refusals.append(Refusal("rollout_tp", "rollout-tp", f"tensor_model_parallel_size {rollout_tp} must divide the "
                                f"{engine_gpus} GPUs and the {heads} attention heads", "choose a common divisor"))
    step_seqs = -(-seqs // dp)
    update = _micro_tokens(b.use_dynamic_bsz, micro, b.ppo_max_token_len_per_gpu, max(mini, 1), b, sp)
    log_prob = _micro_tokens(b.use_dynamic_bsz, b.log_prob_micro_batch_size_per_gpu,
                             b.log_prob_max_token_len_per_gpu, step_seqs, b, sp)
    micro_count = (_dynamic_count(max(mini, 1), b.seq_tokens, b.ppo_max_token_len_per_gpu * sp) if b.use_dynamic_bsz
                   else max(mini, 1) // micro)
    run, lp_run = update, log_prob
    if b.use_dynamic_bsz:
        run = _balanced_tokens(max(mini, 1), b.seq_tokens, micro_count, sp)
        lp_run = _balanced_tokens(step_seqs, b.seq_tokens, _dynamic_count(
            step_seqs, b.seq_tokens, b.log_prob_max_token_len_per_gpu * sp), sp)
    return BatchPlan(data_parallel=dp, sequences_per_step=seqs,
                     mini_batches_per_step=max(1, b.train_batch_size // b.ppo_mini_batch_size),
                     mini_batch_seqs_per_rank=mini, micro_batches_per_mini=micro_count,
                     update_tokens_per_gpu=update, log_prob_tokens_per_gpu=log_prob, step_seqs_per_rank=step_seqs,
                     rollout_seqs_per_replica=-(-seqs // max(1, engine_gpus // rollout_tp)), refusals=tuple(refusals),
                     update_run_tokens_per_gpu=run, log_prob_run_tokens_per_gpu=lp_run, ulysses=sp,
                     seq_tokens=b.seq_tokens, response_tokens=b.seq_response_tokens)


def _dynamic_count(seqs: int, seq_tokens: int, budget: int) -> int:
    """verl utils/seqlen_balancing.py rearrange_micro_batches (0.9.1): from ceil(total tokens / max_token_len)
    micro-batches it adds one until the balanced partition of whole sequences keeps each within max_token_len; with
    every sequence at its mean length (as the step time prices them) a micro-batch holds budget // length."""
    return -(-seqs // max(1, budget // seq_tokens))


def _balanced_tokens(seqs: int, seq_tokens: int, count: int, sp: int) -> int:
    """A balanced micro-batch's tokens on one GPU: the rank's real tokens over the count, split by Ulysses."""
    return -(-seqs * seq_tokens // (count * sp))
