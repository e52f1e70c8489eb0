"""The blockwise path (attention/lse.py blockwise_attention, what SDPA runs for packed documents
past MASK_TOKENS) against the full-mask SDPA reference, and what `auto` and the start-up log say.

Reference: torch SDPA in fp32 with the explicit [b, 1, s, s] bool mask (same document, causal,
sliding window), gradients by autograd. Random shapes (b, s, h, g, block drawn per seed), documents
with one-token documents and a document spanning a whole row. Tolerances, fp32: forward 1e-5,
gradients 1e-4. Memory: the saved-tensor accountant over a packed 16K-token sequence through a
model sees no tensor of s x s elements.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron_sp.attention import backends, describe_attention, get_attention_backend
from megatron_sp.attention.backends import SDPAAttention
from megatron_sp.attention.documents import document_causal_mask
from megatron_sp.attention.blockwise import blockwise_attention, blockwise_pairs
from megatron_sp.errors import ConfigError
from megatron_sp.memory.accounting import SavedTensorAccountant

FWD_TOL, GRAD_TOL = 1e-5, 1e-4


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def allowed_mask(ids, s, causal=True, window=None, b=1):
    """[b, s, s] bool, True = attend: same document (ids None: all), causal, inside the window."""
    allowed = (document_causal_mask(ids, causal=causal)[:, 0] if ids is not None else
               torch.ones(b, s, s, dtype=torch.bool).tril() if causal else
               torch.ones(b, s, s, dtype=torch.bool))
    if window is not None:
        i = torch.arange(s)
        allowed = allowed & (i[:, None] - i[None, :] < window)
    return allowed


def reference(q, k, v, allowed, scale=None):
    """Full-mask SDPA: q [b, s, h, d], k, v [b, s, g, d], allowed [b, s, s] -> [b, s, h, d]."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=allowed[:, None], scale=scale,
                                          enable_gqa=True).transpose(1, 2)


def random_documents(gen, b, s):
    """[b, s] ids: row 0 one document over the whole row; row 1 (if any) starts with one-token
    documents then random runs; further rows random runs (ids repeat after a change: new docs)."""
    ids = (torch.rand(b, s, generator=gen) < 0.15).long().cumsum(1) % 3
    ids[0] = 5                                                 # a document spanning the row
    if b > 1:
        n = min(s, 4)
        ids[1, :n] = torch.arange(10, 10 + n)                  # one-token documents
    return ids


def grads(fn, q, k, v, dout):
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*qkv)
    out.backward(dout)
    return out.detach(), [t.grad for t in qkv]


def assert_close(got, want, tol, what):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > {tol}"


@pytest.mark.parametrize("seed", range(6))
def test_blockwise_matches_full_mask_sdpa_on_random_shapes(seed):
    """Forward and gradients on random shapes: documents (one-token, whole-row), sliding window,
    GQA, several block sizes (one block, blocks not dividing s; one-token blocks are in
    test_attention_lse)."""
    gen = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 4, (1,), generator=gen))
    s = int(torch.randint(5, 48, (1,), generator=gen))
    g = int(torch.randint(1, 3, (1,), generator=gen))
    h, d = g * int(torch.randint(1, 4, (1,), generator=gen)), 8
    q, k, v, dout = (torch.randn(b, s, n, d, generator=gen) for n in (h, g, g, h))
    ids = random_documents(gen, b, s) if seed % 3 else None
    window = int(torch.randint(1, s + 1, (1,), generator=gen)) if seed % 2 else None
    scale = 0.3 if seed == 4 else None
    want, want_grads = grads(lambda *t: reference(*t, allowed_mask(ids, s, True, window, b),
                                                  scale), q, k, v, dout)
    for block in (5, 16, None):
        got, got_grads = grads(lambda *t: blockwise_attention(
            *t, causal=True, scale=scale, block=block, document_ids=ids, window=window),
            q, k, v, dout)
        case = f"b={b} s={s} h={h} g={g} window={window} docs={ids is not None} block={block}"
        assert got.shape == q.shape and got.dtype == q.dtype
        assert_close(got, want, FWD_TOL, f"out, {case}")
        for name, x, y in zip("qkv", got_grads, want_grads):
            assert_close(x, y, GRAD_TOL, f"d{name}, {case}")


def test_window_skips_and_masks_the_right_pairs():
    """s = 32 in blocks of 8 (4 x 4), window 8: a key block wholly 8+ tokens behind its query
    block is skipped, the diagonal and the block just behind are kept; only the one behind needs
    a window mask (the diagonal's causal mask already lies within the window)."""
    pairs = {(p.q.start // 8, p.k.start // 8): p for p in blockwise_pairs(32, 8, True, window=8)}
    assert sorted(pairs) == [(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3)]
    assert all(pairs[(i, i)].window is None for i in range(4))
    assert all(pairs[(i + 1, i)].window == 8 for i in range(3))
    with pytest.raises(ValueError, match="sliding window needs causal"):
        blockwise_attention(*(torch.zeros(1, 4, 1, 8),) * 3, causal=False, window=2)


def test_sdpa_backend_long_documents_never_build_the_mask_and_refuse_dropout(monkeypatch):
    """Past MASK_TOKENS (lowered to 16) SDPA's packed documents go blockwise: no s x s mask is
    built; with dropout (which blockwise lacks) the run is refused in one sentence."""
    monkeypatch.setattr(backends, "MASK_TOKENS", 16)
    monkeypatch.setattr(backends, "document_causal_mask",
                        lambda *a, **kw: pytest.fail("an s x s mask was built"))
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, 40, n, 8, generator=gen) for n in (4, 2, 2, 4))
    ids = random_documents(gen, 2, 40)
    want, want_grads = grads(lambda *t: reference(*t, allowed_mask(ids, 40, b=2)), q, k, v, dout)
    got, got_grads = grads(lambda *t: SDPAAttention()(*t, document_ids=ids), q, k, v, dout)
    assert_close(got, want, FWD_TOL, "out")
    for name, x, y in zip("qkv", got_grads, want_grads):
        assert_close(x, y, GRAD_TOL, f"d{name}")
    with pytest.raises(ConfigError, match=r"^packed documents .* at 40 tokens with attention "
                                          r"dropout .* pass --attention-dropout 0"):
        SDPAAttention()(q, k, v, document_ids=ids, dropout_p=0.1)


class _LargestSaved(SavedTensorAccountant):
    """The accountant, also keeping the largest number of elements of any one saved tensor."""

    largest = 0

    def _pack(self, t):
        self.largest = max(self.largest, t.numel())
        return super()._pack(t)


def test_packed_16k_sequence_saves_no_s_by_s_tensor():
    """A 16K-token packed sequence through a one-layer model (SDPA, auto on CPU -> blockwise):
    no saved tensor has s x s elements, and all saved bytes together are below one s x s bool
    mask (268 MB); the loss is finite and every parameter gets a gradient."""
    from megatron_sp.models import GPTModel, preset
    s = 16384
    cfg = preset("llama-tiny", num_layers=1, hidden_size=32, num_attention_heads=2,
                 num_query_groups=1, ffn_hidden_size=64, vocab_size=128,
                 max_position_embeddings=s)
    model = GPTModel(cfg, attention_backend="auto")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (1, s + 1), generator=gen)
    docs = (torch.rand(1, s, generator=gen) < 1 / 2000).long().cumsum(1)   # ~8 documents
    acct = _LargestSaved().attach(model)
    with acct.recording():
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:], document_ids=docs).sum()
        loss.backward()
    report = acct.report()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    assert 0 < acct.largest < s * s, acct.largest
    assert report["device_bytes"] < s * s, report          # < one s x s bool mask in all


def test_auto_picks_blockwise_on_cpu_and_flex_on_cuda(monkeypatch):
    """auto without TE / flash-attn: SDPA whose long packed documents go blockwise on CPU and
    through FlexAttention on CUDA; the start-up line says which."""
    assert get_attention_backend("auto").long_documents == "blockwise"
    monkeypatch.setitem(__import__("sys").modules, "flash_attn", None)
    monkeypatch.setitem(__import__("sys").modules, "transformer_engine", None)
    monkeypatch.setitem(__import__("sys").modules, "transformer_engine.pytorch", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backend = get_attention_backend("auto")
    assert backend.name == "sdpa" and backend.long_documents == "flex"
    assert get_attention_backend("sdpa").long_documents == "blockwise"
    line = describe_attention("sdpa", requested="auto", device=torch.device("cpu"),
                              dtype=torch.float32, seq_len=8192, packed=True, dropout=0.0)
    assert line == ("SDPA on CPU: flash kernel (fp32); packed documents: each document's causal "
                    "square through aten's CPU flash kernel, one call per segment (blockwise "
                    "attention, no mask)")


@pytest.mark.parametrize("packed", [False, True])
def test_startup_lines_name_the_ring_once(packed, capsys):
    """Under --context-parallel-size 4 the ring is the model's attention: the start-up lines name
    it once ("> attention backend: ring ..."), the "> attention:" line says what the ring does
    instead of repeating the name, and no start-up line repeats another's text (issue 34)."""
    import os
    import sys
    from types import SimpleNamespace

    from megatron_sp.cli.build import parse_job
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import GPTConfig
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import pretrain_gpt
    job = parse_job(["--mock-data", "--seq-length", "64", "--context-parallel-size", "4",
                     "--attention-dropout", "0"] + (["--reset-attention-mask"] if packed else []))
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512,
                       attention_dropout=0.0)
    name = "ring over cp=4 (segments, attention/block_kernels.py)"
    chunk = SimpleNamespace(attention_backend_name=name,
                            parameters=lambda: iter([torch.zeros(1)]))
    pretrain_gpt.say_startup(job, ParallelMesh.single(), config, [chunk])
    lines = capsys.readouterr().out.splitlines()
    assert lines.count(f"> attention backend: {name}") == 1
    assert sum("ring over cp=4" in line for line in lines) == 1, lines
    described = [line for line in lines if line.startswith("> attention: ")]
    assert len(described) == 1 and "log-sum-exp" in described[0], lines
    assert ("packed documents as segments planned once per step" in described[0]) is packed
    said = [line.split(": ", 1)[-1] for line in lines]
    assert len(set(lines)) == len(lines) and len(set(said)) == len(said), lines
