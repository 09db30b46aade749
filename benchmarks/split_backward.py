"""Zero-bubble's split backward against the full one, on a real pipeline stage (two Llama blocks).

    OMP_NUM_THREADS=1 python benchmarks/split_backward.py

torch.distributed.pipelining's own functions: stage_backward (what 1F1B runs) against stage_backward_input (I) then
stage_backward_weight (W), as ScheduleInterleavedZeroBubble and DualPipeV run them; the median of 8 after 2 warm-ups,
on whatever device torch computes on here (CPU). cost_models/pipeline_time.py prices W as half of each trained
matmul's backward at the fused backward's rate, I + W = the full backward.
"""
import time, statistics, torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=8,
                  num_hidden_layers=2, attn_implementation="sdpa")
class Stage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(2)])
        self.rope = LlamaRotaryEmbedding(cfg)
    def forward(self, x):
        pos = torch.arange(x.shape[1])[None]
        pe = self.rope(x, pos)
        for l in self.layers:
            x = l(x, position_embeddings=pe, attention_mask=None)
            x = x[0] if isinstance(x, tuple) else x
        return x
m = Stage()
def run(split):
    x = torch.randn(2, 512, 1024, requires_grad=True)
    out = m(x)
    g = torch.randn_like(out)
    t0 = time.perf_counter()
    if split:
        _, groups = stage_backward_input([out], [g], [x], m.parameters())
        t1 = time.perf_counter()
        stage_backward_weight(m.parameters(), groups)
        t2 = time.perf_counter()
        return t2 - t0, t1 - t0, t2 - t1
    stage_backward([out], [g], [x])
    return time.perf_counter() - t0, 0, 0
for _ in range(2): run(False); run(True)
full, split, i_s, w_s = [], [], [], []
for _ in range(8):
    full.append(run(False)[0]); s, i, w = run(True); split.append(s); i_s.append(i); w_s.append(w)
f, s = statistics.median(full), statistics.median(split)
print(f"full backward {f*1e3:.1f} ms; split I {statistics.median(i_s)*1e3:.1f} + W {statistics.median(w_s)*1e3:.1f} = {s*1e3:.1f} ms; split/full {s/f:.3f}; W/full {statistics.median(w_s)/f:.3f}")
