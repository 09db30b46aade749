"""Models for the calibration tests: `--factory tests.distributed.calib_models:small_llama`."""

from calibration.reference import build_reference, tiny_llama_spec


def small_llama(n_layers: int = 4):
    """A Llama-style decoder of 0.86M parameters (GQA, SwiGLU, RMSNorm, rotary): large enough that
    matmuls dominate a CPU step, small enough for a 2-core CI machine. `.spec` is its exact ModelSpec."""
    spec = tiny_llama_spec(name="small-llama", n_layers=n_layers, hidden_size=128, n_heads=4, n_kv_heads=2,
                           head_dim=32, ffn_hidden_size=344, vocab_size=512)
    return build_reference(spec)
