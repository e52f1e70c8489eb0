"""The planner's saved bytes with Ulysses head chunks hold at sp 2 (issue 36; the sp 1 cases are in
tests/unit/test_planner_head_chunks.py).

One spawn of 2 gloo ranks (sp 2), a 2-layer Llama (hidden 64, 8 heads, RoPE, RMSNorm, SwiGLU),
b = 2, s = 128, under bf16 autocast: GQA with 4 key/value heads (N = 2: split; N = 4: shared by
pairs of chunks) and MQA (1 key/value head, replicated over sp, shared by every chunk), plain and
with head chunks. Each rank's per-layer and all-layer saved bytes (the SavedTensorAccountant, what
--report-memory prints) against activation_bytes(..., sp=2, memory=MemoryOptions(
ulysses_head_chunks=N)) within 10%, and the bytes the chunks save (plain minus chunked: the
head-layout SDPA output and lse, the replicated key/value heads) within 10% of the planner's.
"""
import pytest
import torch

from megatron_sp.memory import MemoryOptions, SavedTensorAccountant
from megatron_sp.memory.accounting import layer_bytes
from megatron_sp.memory.planner import activation_bytes
from megatron_sp.mesh import ParallelMesh
from megatron_sp.models import GPTModel, preset
from megatron_sp.models.init import init_parameters
from megatron_sp.testing import run_distributed

TOL = 0.10
B, S, SP = 2, 128, 2
CASES = {"gqa": (4, (1, 2, 4)), "mqa": (1, (1, 2, 4))}


def _cfg(groups):
    return preset("llama-tiny", num_layers=2, hidden_size=64, num_attention_heads=8,
                  num_query_groups=groups, ffn_hidden_size=128, vocab_size=300)


def _measure(rank, world, seed):
    torch.set_num_threads(1)
    mesh = ParallelMesh.from_sizes(sp=SP)
    out = {}
    for name, (groups, chunks) in CASES.items():
        cfg = _cfg(groups)
        for n in chunks:
            gen = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
            model = GPTModel(cfg, mesh, memory=MemoryOptions(ulysses_head_chunks=n))
            init_parameters(model, seed=seed)
            acct = SavedTensorAccountant().attach(model)
            with acct.recording(), torch.autocast("cpu", torch.bfloat16):
                model(input_ids=ids, labels=ids).float().sum().backward()
            acct.detach()
            out[(name, n)] = layer_bytes(acct.report())
    return out


@pytest.mark.timeout(200)
def test_planner_saved_bytes_with_head_chunks_at_sp2(seed):
    results = run_distributed(_measure, SP, seed)
    rows, bad = [], []
    for name, (groups, chunks) in CASES.items():
        cfg = _cfg(groups)
        pred = {n: activation_bytes(cfg, S, B, sp=SP, device="cpu", dtype_bytes=2,
                                    residual_bytes=4, memory=MemoryOptions(ulysses_head_chunks=n))
                for n in chunks}
        for rank, measured in enumerate(results):
            plain = sum(measured[(name, 1)].values())
            for n in chunks:
                layers = measured[(name, n)]
                per_layer = max(layers.values()) - pred[n]["shared"]   # RoPE under layer 0
                ratio = pred[n]["layer"] / per_layer
                ratio_sum = (pred[n]["layers"] + pred[n]["shared"]) / sum(layers.values())
                saved = plain - sum(layers.values())
                planned = pred[1]["layers"] - pred[n]["layers"]
                rows.append(f"{name} N={n} rank {rank}: per layer measured {per_layer} planned "
                            f"{pred[n]['layer']:.0f} ratio {ratio:.4f}; layers ratio "
                            f"{ratio_sum:.4f}; chunks save {saved} B, planned {planned:.0f} B")
                ok = abs(ratio - 1) <= TOL and abs(ratio_sum - 1) <= TOL
                if n > 1:
                    ok = ok and saved > 0 and abs(saved - planned) <= TOL * saved
                if not ok:
                    bad.append(rows[-1])
    print("\n".join(rows))
    assert not bad, "\n".join(bad)
