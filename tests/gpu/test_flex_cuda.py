"""GPU check of FlexAttention for gpt-oss: on CUDA, calibration/flex_kernel.py hands transformers' own flex path
(the compiled Triton kernel, the sinks through its logsumexp) the call; its loss and gradients against eager, and
the attention's saved bytes against cost_models/activations_sinks.py's flex formula - what tests/unit/
test_attention_flex.py checks on CPU with the dense implementation. Skipped without CUDA (CI and the development
machines have none): `pytest tests/gpu/test_flex_cuda.py` on a GPU host."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")]


def test_gpt_oss_flex_on_cuda_matches_eager_and_saves_the_formula(attention_saved_bytes):
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from calibration.flex_kernel import use_flex
    from cost_models import attention_flex
    from cost_models.activations_sinks import sink_attention_bytes
    from cost_models.specs import Attention
    from planner.models import from_hf_config

    hf = dict(model_type="gpt_oss", vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
              sliding_window=128, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048,
              use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **fields),
                                             attn_implementation="eager").to("cuda", torch.bfloat16)
    flex = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **fields),
                                            attn_implementation=use_flex()).to("cuda", torch.bfloat16)
    flex.load_state_dict(eager.state_dict())
    batch, seq = 2, 1024
    ids = torch.randint(0, 512, (batch, seq), device="cuda")
    loss, per_layer = attention_saved_bytes(flex, lambda: flex(input_ids=ids, labels=ids).loss)
    reference = eager(input_ids=ids, labels=ids).loss
    loss.backward(), reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=2e-2)  # bf16 kernels
    expected = batch * seq * sink_attention_bytes(from_hf_config(hf), 2, seq, Attention.FLEX) + \
        attention_flex.block_mask_bytes(seq, batch)
    # the compiled graph's saved set (q, k, v, out, logsumexp) within 2%: inductor may keep its own layout copies
    assert per_layer == [pytest.approx(expected, rel=0.02)] * 2
