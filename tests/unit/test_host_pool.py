"""The exact host pool (megatron_sp/memory/host_pool.py): blocks never overlap, are aligned, come back
as a stack; its two error sentences; offloaded activations in a pool give the plain gradients, and
the planner counts the pool exactly where it is used (torch's power-of-two rounding elsewhere)."""
import gc
import random

import pytest
import torch

from megatron_sp.errors import ConfigError, UserError
from megatron_sp.memory import MemoryOptions
from megatron_sp.memory import host_pool as hp
from megatron_sp.memory.host_pool import ALIGNMENT, HostPool, HostPoolError, align_up
from megatron_sp.memory.planner import (host_state_pinned_bytes, pinned_bytes, step_peak_bytes)
from megatron_sp.models import GPTModel, preset
from megatron_sp.models.init import init_parameters

DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_blocks_never_overlap_and_are_aligned(seed):
    rng = random.Random(seed)
    pool = HostPool(1 << 20, pin=False)
    live = []                                   # (tensor, start, end, fill value)
    for step in range(400):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live)))            # any order: deferred pop
        else:
            dtype = rng.choice(DTYPES)
            shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
            try:
                t = pool.empty(shape, dtype)
            except HostPoolError:
                continue
            start = t.data_ptr() - pool.slab.data_ptr()
            assert start % ALIGNMENT == 0 and t.shape == shape and t.dtype == dtype
            end = start + t.numel() * t.element_size()
            assert end <= pool.capacity
            for _, s, e, _ in live:
                assert end <= s or e <= start, "blocks overlap"
            t.fill_(step % 100)
            live.append((t, start, end, step % 100))
            del t
        if step % 50 == 0:
            for x, _, _, v in live:                       # nothing written over a live block
                assert bool((x == v).all())
            del x
    live.clear()
    assert pool.used == 0 and len(pool) == 0


def test_stack_order_and_release_rules():
    pool = HostPool(8 * ALIGNMENT, pin=False)
    a = pool.empty((10,), torch.float32)
    b = pool.empty((ALIGNMENT + 1,), torch.uint8)         # two aligned units
    c = pool.empty((3, 4), torch.float16)
    assert [pool.offset(x) for x in (a, b, c)] == [0, ALIGNMENT, 3 * ALIGNMENT]
    assert pool.used == 4 * ALIGNMENT
    pool.release(b)                                       # below a live block: not reclaimed yet
    assert pool.used == 4 * ALIGNMENT
    d = pool.empty((1,), torch.float32)                   # so the hole is never handed out
    assert pool.offset(d) == 4 * ALIGNMENT
    pool.release(d)
    pool.release(c)                                       # the top pops past c, and b below it
    assert pool.used == ALIGNMENT and len(pool) == 1
    with pytest.raises(ValueError, match="released twice"):
        pool.release(c)
    with pytest.raises(ValueError, match="does not live in this pool"):
        pool.release(torch.empty(4))
    del a                                                 # freeing the tensor returns its block
    gc.collect()
    assert pool.used == 0
    v = pool.empty((4, 8), torch.float32)
    w = v.t()[1:]                                         # a view keeps its block alive
    del v
    gc.collect()
    assert pool.used == ALIGNMENT
    del w
    gc.collect()
    assert pool.used == 0


def test_strided_blocks_and_no_power_of_two_rounding():
    pool = HostPool(3 * 2**20 + 5, pin=False)
    assert pool.capacity == align_up(3 * 2**20 + 5) < pinned_bytes(3 * 2**20 + 5)
    t = pool.empty((2, 3, 4), torch.float32, stride=(24, 1, 6))
    src = torch.randn(4, 3, 2).permute(2, 1, 0)
    assert t.stride() == (24, 1, 6)
    t.copy_(src)
    assert torch.equal(t, src)


def test_exhausted_pool_says_sizes_and_what_to_raise():
    pool = HostPool(2**20, pin=False, what="offloaded activations",
                    remedy="raise --offload-pool-gb")
    keep = pool.empty((2**18 - 1000,), torch.float32)
    with pytest.raises(HostPoolError) as err:
        pool.empty((1024, 1024), torch.float32)
    msg = str(err.value)
    assert isinstance(err.value, ConfigError) and isinstance(err.value, UserError)
    assert msg == ("the pinned host pool for offloaded activations is exhausted: a tensor of "
                   "4.00 MiB (1024, 1024) float32 does not fit in the 0.00 MiB left of 1.00 MiB "
                   "(1.00 MiB in use); raise --offload-pool-gb.")
    assert msg.count(". ") == 0                           # one sentence
    del keep


def test_slab_that_cannot_be_pinned_is_one_sentence(monkeypatch):
    real = torch.empty

    def refuse(*args, pin_memory=False, **kw):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory\nmore lines")
        return real(*args, **kw)
    monkeypatch.setattr(hp.torch, "empty", refuse)
    with pytest.raises(HostPoolError) as err:
        HostPool(12.5 * 2**30, pin=True, what="offloaded activations",
                 remedy="lower --seq-length or give --offload-pool-gb a larger size")
    assert str(err.value) == (
        "the host cannot pin 12.50 GiB that the plan needs for offloaded activations (CUDA error: "
        "out of memory); lower --seq-length or give --offload-pool-gb a larger size.")


CFGS = {"llama": ("llama-tiny", dict(num_layers=4, hidden_size=64, num_attention_heads=8,
                                     num_query_groups=4, ffn_hidden_size=96, vocab_size=300)),
        "gpt2": ("gpt2-tiny", dict(num_layers=4, hidden_size=64, num_attention_heads=8,
                                   vocab_size=300, max_position_embeddings=128))}


def _grads(cfg, mem, pool=None, b=2, s=96):
    model = GPTModel(cfg, memory=mem)
    init_parameters(model, seed=1)
    model.host_pool = pool
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    loss = model(ids, labels=labels).mean()
    peak = pool.peak if pool is not None else None
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, peak


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("group", [1, 2])
def test_pooled_offload_gives_the_same_gradients_and_the_planners_bytes(name, group):
    cfg = preset(CFGS[name][0], **CFGS[name][1])
    mem = MemoryOptions(recompute_granularity="full", recompute_num_layers=group,
                        offload_activations=True)
    l0, g0, _ = _grads(cfg, MemoryOptions())
    exact = step_peak_bytes(cfg, 96, 2, memory=mem, dtype_bytes=4, device="cpu",
                            host_pool=True)["host"]
    pool = HostPool(exact, pin=False)                     # sized from the plan: exactly enough
    for _ in range(2):                                    # the second step reuses the slab
        loss, grads, peak = _grads(cfg, mem, pool)
        assert abs(loss - l0) <= 1e-6 * abs(l0)
        for n, g in grads.items():
            assert torch.equal(g, g0[n]), n
        assert peak == exact == pool.capacity
        gc.collect()
        assert pool.used == 0


def test_planner_counts_the_pool_exactly_and_fsdp2_rounds():
    cfg = preset("llama-8b")
    mem = MemoryOptions(recompute_granularity="full", offload_activations=True)
    seq = 4 * 2**20 + 8 * 1024                            # layer inputs just over a power of two
    kw = dict(sp=8, memory=mem, dtype_bytes=2, residual_bytes=2)
    ckpt = seq / 8 * cfg.hidden_size * 2
    pooled = step_peak_bytes(cfg, seq, **kw, host_pool=True)["host"]
    rounded = step_peak_bytes(cfg, seq, **kw)["host"]
    tables = 2 * seq / 8 * cfg.kv_channels * 4
    assert pooled == 32 * align_up(ckpt) + 2 * align_up(tables / 2)
    assert rounded == 32 * pinned_bytes(ckpt) + tables > 1.9 * pooled
    fsdp = host_state_pinned_bytes(cfg, 1, 1, 8)
    pool = host_state_pinned_bytes(cfg, 1, 1, 8, pool=True)
    assert pool < fsdp
    assert abs(pool / (16 * 8.03e9 / 8) - 1) < 0.01       # 16 bytes/param / n, nothing rounded
