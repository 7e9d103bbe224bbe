import torch, sys
def mk():
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2).float() / 128))
    t = torch.arange(4096).float()
    freqs = torch.einsum("i,j->ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1), freqs, inv_freq
def state(tag):
    print(tag, "threads", torch.get_num_threads(), "prec", torch.get_float32_matmul_precision(),
          "cap", torch.backends.cpu.get_cpu_capability(), flush=True)
state("start"); A, fA, iA = mk(); A2, fA2, _ = mk()
print("A==A2", torch.equal(A, A2), torch.equal(fA, fA2))
outer = iA[None, :] * torch.arange(4096).float()[:, None]
print("einsum == broadcast mul", torch.equal(fA, outer), (fA - outer).abs().max().item())
import transformers
state("after transformers"); B, fB, _ = mk()
print("A==B", torch.equal(A, B), torch.equal(fA, fB), (A - B).abs().max().item())
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
state("after qwen3 modeling"); C, fC, _ = mk()
print("A==C", torch.equal(A, C), torch.equal(fA, fC), (A - C).abs().max().item())
from minivllm.layers.rotary_embedding import RotaryEmbedding
state("after minivllm"); D, fD, _ = mk()
print("A==D", torch.equal(A, D), torch.equal(fA, fD), (A - D).abs().max().item())
rope = RotaryEmbedding(128, 128, 4096, 1e6)
print("module==D", torch.equal(rope.cos_sin_cache[:, 0], D), (rope.cos_sin_cache[:, 0] - D).abs().max().item())
print("module==A", torch.equal(rope.cos_sin_cache[:, 0], A))
for n in (1, 4, 16):
    torch.set_num_threads(n); E, fE, _ = mk()
    print("threads", n, "A==E", torch.equal(A, E), torch.equal(fA, fE), (A - E).abs().max().item())
