"""megatron_sp.hf: unmodified transformers causal LMs under our Ulysses train like one process.

One 4-rank gloo spawn. For tiny random llama, mistral, qwen2, qwen3 and gpt2 models built from
configs (2 layers, hidden 64, 4 or 8 heads, 1 or 2 kv heads so that kv < sp occurs, sdpa), in
three layouts,
  sp4            one sp group of 4 ranks (the sequence 30 is padded to 32 by shard_batch),
  sp2            two sp groups of 2, each running the whole global batch,
  dp2 x sp2      sp pairs, dp over the pairs, each replica half of the global batch with a
                 different number of masked labels (the loss is the global token mean),
and the mixtures of experts qwen3_moe (sp4), qwen2_moe (sp2: a gated shared expert, q/k/v bias)
and mixtral (dp2 x sp2), each rank routing its own
tokens; three SGD steps: the loss equals the unsharded model's (HF's own loss on the same global batch)
to LOSS_TOL relative, and the gradients averaged over the dp x sp ranks that share the
parameters equal the unsharded gradients to GRAD_TOL (absolute, fp32).
Packed documents (position_ids restarting at 0, documents crossing the sp chunks) at sp4 and
dp2 x sp2 give the block-diagonal reference: each document run alone through the unsharded model;
also past MASK_TOKENS (lowered to 16: the SDPA backend's blockwise path), and through the
flash_attention_2 path (cu_seq_lens varlen kwargs) with a stand-in SDPA kernel, as flash-attn is
not installed. Left and right padding (attention_mask) equal the unsharded masked model.
tiled_loss equals loss; a chunk whose labels are all masked gives no NaN and the right gradients;
a batch with no unmasked token gives loss 0 and zero gradients. Refusals say one sentence.
Measured worst differences (fp32): loss 2e-7 relative, gradients 2e-7 absolute.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_sp.testing import run_distributed

WORLD = 4
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
VOCAB, SEQ, STEPS, LR = 128, 32, 3, 0.5

FAMILIES = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(num_attention_heads=8, num_key_value_heads=1),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=1),
    "qwen3": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    "gpt2": dict(n_head=4),
}
# Mixtures of experts (issue 37): each rank routes its own tokens (no router loss: HF's
# output_router_logits is off), so sp changes nothing but the attention; one layout each.
MOE_FAMILIES = {
    "qwen3_moe": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=32),
}


def build(family: str, seed: int = 0, attn: str = "sdpa", **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM
    if family == "gpt2":
        kw = dict(n_embd=64, n_layer=2, n_positions=64, vocab_size=VOCAB, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    else:
        kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=VOCAB,
                  max_position_embeddings=64, tie_word_embeddings=False)
    kw.update({**FAMILIES, **MOE_FAMILIES}.get(family, {}), loss_type="ForCausalLM", **overrides)
    config = AutoConfig.for_model(family, **kw)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()


def random_batch(gen, rows: int, seq: int, mask_frac: float = 0.2) -> dict:
    ids = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    labels = ids.clone()
    labels[torch.rand(rows, seq, generator=gen) < mask_frac] = -100
    return {"input_ids": ids, "labels": labels}


def packed_positions(lengths_per_row) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


# The unsharded references --------------------------------------------------------------------

def reference_step(model, batch):
    """HF's own loss (mean over the shifted, unmasked tokens) of the whole global batch."""
    out = model(input_ids=batch["input_ids"], labels=batch["labels"],
                position_ids=batch.get("position_ids"))
    return out.loss


def reference_packed(model, batch, lengths_per_row):
    """Block-diagonal reference: every document alone through the model; the mean over all
    documents' shifted unmasked tokens."""
    total, count = 0.0, 0
    for row, lengths in enumerate(lengths_per_row):
        start = 0
        for n in lengths:
            ids = batch["input_ids"][row:row + 1, start:start + n]
            labels = batch["labels"][row:row + 1, start:start + n]
            logits = model(input_ids=ids).logits.float()
            targets = labels[:, 1:]
            total = total + torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100,
                reduction="sum")
            count += int((targets != -100).sum())
            start += n
    return total / count


# Helpers on the ranks ------------------------------------------------------------------------

def _groups(rank):
    """sp4 (the world), sp pairs {0,1} {2,3}, dp pairs {0,2} {1,3}: new_group on every rank."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return dict(world=dist.group.WORLD, sp2=pairs[rank // 2], dp2=dps[rank % 2])


def _average_grads(model, group, n):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(n)


def _grad_diff(model, ref, relative=False):
    """Worst |g - g_ref| over the parameters (relative: divided by the parameter's max |g_ref|)."""
    worst = 0.0
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.shape == r.shape, name
        g = torch.zeros_like(p) if p.grad is None else p.grad
        gr = torch.zeros_like(r) if r.grad is None else r.grad
        diff = float((g - gr).abs().max())
        worst = max(worst, diff / max(float(gr.abs().max()), 1e-12) if relative else diff)
    return worst


def _pair(family, inner="sdpa"):
    """The unsharded model and a copy (same weights) set to attention `inner` before wrapping."""
    from megatron_sp.hf import sequence_parallel
    ref = build(family)
    model = build(family)
    model.load_state_dict(ref.state_dict())
    model.config._attn_implementation = inner
    return ref, model, sequence_parallel


STAND_IN_CALLS = []        # per call: whether it had varlen kwargs (documents)


def stand_in_flash(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    """flash_attention_2's calling convention with an SDPA kernel (flash-attn is not installed):
    checks what the wrapper hands it (the original implementation name, no mask, the global
    position_ids) and attends each cu_seq_lens segment of the flattened b*s tokens causally."""
    b, h, s, d = query.shape
    STAND_IN_CALLS.append(kw.get("cu_seq_lens_q") is not None)
    assert module.config._attn_implementation == "flash_attention_2"
    assert attention_mask is None and tuple(kw["position_ids"].shape) == (b, s)
    cu = kw.get("cu_seq_lens_q")
    if cu is None:                                   # no documents: one segment per row
        cu = torch.arange(0, b * s + 1, s)
    else:
        assert kw["max_length_q"] == int((cu[1:] - cu[:-1]).max())
    # [b, heads, s, d] -> [b*s, heads, d]
    q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (query, key, value))
    out = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seg = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]   # [1, heads, n, d]
        o = torch.nn.functional.scaled_dot_product_attention(*seg, is_causal=True, scale=scaling,
                                                             enable_gqa=True)
        out.append(o[0].transpose(0, 1))                                 # [n, h, d]
    return torch.cat(out).view(b, s, h, d), None


LAYOUTS = {   # name: (sp group key, dp group key or None, world-size of the averaging group)
    "sp4": ("world", None, 4),
    "sp2": ("sp2", None, 2),
    "dp2 x sp2": ("sp2", "dp2", 4),
}


def _train_layout(rank, groups, family, layout, seed, inner="sdpa"):
    """Three SGD steps of the sharded model beside the unsharded one; the worst differences."""
    from megatron_sp.hf import loss, shard_batch
    sp_key, dp_key, n_avg = LAYOUTS[layout]
    sp_group, dp_group = groups[sp_key], groups[dp_key] if dp_key else None
    avg_group = groups["world"] if n_avg == 4 else sp_group
    ref, model, sequence_parallel = _pair(family, inner)
    sequence_parallel(model, sp_group)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    seq = 30 if layout == "sp4" else SEQ                 # sp4: 30 -> 32, two pads
    worst = dict(loss_rel=0.0, grad_abs=0.0)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(seed + 1000 * step)
        batch = random_batch(gen, 4, seq)
        batch["labels"][2:, : seq // 2] = -100           # replica 1 has fewer tokens than 0
        mine = batch
        if dp_key:                                        # dp rank = which pair: half the rows
            rows = slice(2 * (rank // 2), 2 * (rank // 2) + 2)
            mine = {k: v[rows] for k, v in batch.items()}
        ref_loss = reference_step(ref, batch)
        shard = shard_batch(mine, sp_group)
        assert "labels" not in shard
        out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
        value = loss(out.logits, shard, sp_group, dp_group=dp_group)
        worst["loss_rel"] = max(worst["loss_rel"],
                                abs(value.item() - ref_loss.item()) / abs(ref_loss.item()))
        opt_ref.zero_grad()
        opt.zero_grad()
        ref_loss.backward()
        value.backward()
        _average_grads(model, avg_group, n_avg)
        worst["grad_abs"] = max(worst["grad_abs"], _grad_diff(model, ref))
        worst["grad_rel"] = max(worst.get("grad_rel", 0.0), _grad_diff(model, ref, relative=True))
        opt_ref.step()
        opt.step()
    return worst


PACKED = [[5, 14, 9, 4], [17, 15]]     # documents of the two rows, crossing the sp chunks
SHORT = [[1] * 8 + [2] * 4 + [16], [32]]  # one-token documents; one spanning every rank's chunk


def _packed(rank, groups, family, layout, seed, inner="sdpa", packed=PACKED):
    """Packed documents: one step, loss and gradients against the per-document reference."""
    from megatron_sp.hf import loss, shard_batch
    sp_key, dp_key, n_avg = LAYOUTS[layout]
    sp_group, dp_group = groups[sp_key], groups[dp_key] if dp_key else None
    ref, model, sequence_parallel = _pair(family, inner)
    sequence_parallel(model, sp_group)
    gen = torch.Generator().manual_seed(seed)
    rows = 2 if dp_key is None else 4
    lengths = packed * (rows // 2)
    batch = random_batch(gen, rows, SEQ)
    batch["position_ids"] = packed_positions(lengths)
    ref_loss = reference_packed(ref, batch, lengths)
    mine = batch
    if dp_key:
        r = slice(2 * (rank // 2), 2 * (rank // 2) + 2)
        mine = {k: v[r] for k, v in batch.items()}
    shard = shard_batch(mine, sp_group)
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    value = loss(out.logits, shard, sp_group, dp_group=dp_group)
    ref_loss.backward()
    value.backward()
    _average_grads(model, groups["world"], 4)
    return dict(loss_rel=abs(value.item() - ref_loss.item()) / ref_loss.item(),
                grad_abs=_grad_diff(model, ref))


def _masked_chunks(rank, groups, seed):
    """sp4 llama: the last rank's chunk has no target (no NaN, right gradients); then a batch with
    no target at all: loss 0 and zero gradients. tiled_loss equals loss, value and gradients."""
    from megatron_sp.hf import loss, shard_batch, tiled_loss
    sp_group = groups["world"]
    ref, model, sequence_parallel = _pair("llama")
    sequence_parallel(model, sp_group)
    gen = torch.Generator().manual_seed(seed)
    batch = random_batch(gen, 2, SEQ)
    batch["labels"][:, 3 * SEQ // 4 - 1:] = -100        # rank 3's targets: all masked
    ref_loss = reference_step(ref, batch)
    shard = shard_batch(batch, sp_group)
    hidden = model.model(input_ids=shard["input_ids"],
                         position_ids=shard["position_ids"]).last_hidden_state
    value = loss(model.lm_head(hidden), shard, sp_group)
    assert math.isfinite(value.item())
    ref_loss.backward()
    value.backward()
    _average_grads(model, sp_group, 4)
    masked = dict(loss_rel=abs(value.item() - ref_loss.item()) / ref_loss.item(),
                  grad_abs=_grad_diff(model, ref))
    # tiled (4 tiles of 2 tokens) against the plain loss: value and gradients
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    hidden = model.model(input_ids=shard["input_ids"],
                         position_ids=shard["position_ids"]).last_hidden_state
    tiled = tiled_loss(hidden, model.lm_head.weight, shard, sp_group, tiles=4)
    tiled.backward()
    _average_grads(model, sp_group, 4)
    tiled_diff = dict(loss_abs=abs(tiled.item() - value.item()),
                      grad_abs=max(float((p.grad - g).abs().max())
                                   for p, g in zip(model.parameters(), grads)))
    # nothing to predict anywhere: 0, finite, zero gradients
    model.zero_grad()
    empty = dict(batch, labels=torch.full_like(batch["labels"], -100))
    shard = shard_batch(empty, sp_group)
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    zero = loss(out.logits, shard, sp_group)
    zero.backward()
    zero_grad = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    return dict(masked=masked, tiled=tiled_diff, empty_loss=zero.item(), empty_grad=zero_grad,
                padded=_padded(sp_group, seed))


def padded_batch(ref, seed: int, s: int, left: int, right_from: int):
    """Two rows of s tokens: row 0 padded on the left ([0, left)), row 1 on the right ([right_from,
    s)) by attention_mask, labels -100 there and at the last left pad; and the unsharded model's
    loss with that mask and the real tokens' positions. -> (batch, positions, reference loss)."""
    batch = random_batch(torch.Generator().manual_seed(seed + 7), 2, s)
    mask = torch.ones(2, s, dtype=torch.long)
    mask[0, :left] = 0
    mask[1, right_from:] = 0
    batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    batch["labels"][0, left] = -100                       # no target for the last left pad
    batch["attention_mask"] = mask
    positions = (mask.cumsum(1) - 1).clamp(min=0).masked_fill(mask == 0, 0)
    ref_loss = ref(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions,
                   labels=batch["labels"]).loss
    return batch, positions, ref_loss


def _padded(sp_group, seed):
    """Left and right padding (attention_mask): the reference is the unsharded model with the
    mask and the real tokens' positions; shard_batch makes the positions, and its pads (each a
    one-token document) keep every real token from attending to a pad."""
    from megatron_sp.hf import loss, shard_batch
    ref, model, sequence_parallel = _pair("qwen3")
    sequence_parallel(model, sp_group)
    # left padding crossing no chunk, right padding over two chunks
    batch, positions, ref_loss = padded_batch(ref, seed, SEQ, 5, 2 * SEQ // 4 + 3)
    shard = shard_batch(batch, sp_group)
    r, c = dist.get_rank(sp_group), SEQ // 4
    assert torch.equal(shard["position_ids"], positions[:, r * c:(r + 1) * c])
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                attention_mask=shard["attention_mask"])
    value = loss(out.logits, shard, sp_group)
    ref_loss.backward()
    value.backward()
    _average_grads(model, sp_group, 4)
    return dict(loss_rel=abs(value.item() - ref_loss.item()) / ref_loss.item(),
                grad_abs=_grad_diff(model, ref))


def _refusals(groups):
    """The one-sentence refusals of sequence_parallel (sp 4) and of the wrapper at run time."""
    from megatron_sp.hf import SequenceParallelError, sequence_parallel, shard_batch
    sp_group = groups["world"]
    cases = {
        "heads": lambda: build("llama", hidden_size=96, num_attention_heads=6,
                               num_key_value_heads=2),
        "kv heads": lambda: build("llama", hidden_size=96, num_attention_heads=12,
                                  num_key_value_heads=3),
        "eager": lambda: build("llama", attn="eager"),
        "family": lambda: build("gpt_neox", hidden_size=64, num_attention_heads=4,
                                num_hidden_layers=1, intermediate_size=128, vocab_size=VOCAB),
    }
    said = {}
    for name, make in cases.items():
        try:
            sequence_parallel(make(), sp_group)
            said[name] = None
        except SequenceParallelError as err:
            said[name] = str(err)
    model = sequence_parallel(build("mistral", sliding_window=8), sp_group)
    shard = shard_batch(random_batch(torch.Generator().manual_seed(3), 1, SEQ), sp_group)
    try:
        model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
        said["window"] = None
    except SequenceParallelError as err:
        said["window"] = str(err)
    try:
        model(input_ids=shard["input_ids"])
        said["positions"] = None
    except SequenceParallelError as err:
        said["positions"] = str(err)
    try:
        sequence_parallel(model, sp_group)
        said["twice"] = None
    except SequenceParallelError as err:
        said["twice"] = str(err)
    return said


def _rank_main(rank, world, seed):
    torch.use_deterministic_algorithms(False)
    groups = _groups(rank)
    results = {}
    for family in FAMILIES:
        for layout in LAYOUTS:
            results[(family, layout)] = _train_layout(rank, groups, family, layout, seed)
        for layout in ("sp4", "dp2 x sp2"):
            results[(family, "packed " + layout)] = _packed(rank, groups, family, layout, seed)
    # long packed sequences: the SDPA backend's blockwise path (no s x s mask) past MASK_TOKENS
    from megatron_sp.attention import backends
    backends.MASK_TOKENS = 16
    results[("qwen3_moe", "sp4")] = _train_layout(rank, groups, "qwen3_moe", "sp4", seed)
    results[("qwen2_moe", "sp2")] = _train_layout(rank, groups, "qwen2_moe", "sp2", seed)
    results[("mixtral", "dp2 x sp2")] = _train_layout(rank, groups, "mixtral", "dp2 x sp2", seed)
    results[("qwen3", "packed sp4 blockwise")] = _packed(rank, groups, "qwen3", "sp4", seed)
    results[("mistral", "packed dp2 x sp2 blockwise")] = _packed(rank, groups, "mistral",
                                                                 "dp2 x sp2", seed)
    backends.MASK_TOKENS = 4096
    results[("llama", "packed sp4 one-token and whole-row documents")] = _packed(
        rank, groups, "llama", "sp4", seed, packed=SHORT)
    # the flash_attention_2 path (cu_seq_lens varlen kwargs) with a stand-in kernel
    from transformers import AttentionInterface
    AttentionInterface._global_mapping["flash_attention_2"], real = (
        stand_in_flash, AttentionInterface._global_mapping["flash_attention_2"])
    results[("qwen3", "sp4 flash_attention_2 stand-in")] = _train_layout(
        rank, groups, "qwen3", "sp4", seed, inner="flash_attention_2")
    results[("qwen2", "packed sp4 flash_attention_2 stand-in")] = _packed(
        rank, groups, "qwen2", "sp4", seed, inner="flash_attention_2")
    results[("llama", "packed dp2 x sp2 flash_attention_2 stand-in")] = _packed(
        rank, groups, "llama", "dp2 x sp2", seed, inner="flash_attention_2")
    AttentionInterface._global_mapping["flash_attention_2"] = real
    results["stand-in calls"] = (STAND_IN_CALLS.count(False), STAND_IN_CALLS.count(True))
    results["masked"] = _masked_chunks(rank, groups, seed)
    results["refusals"] = _refusals(groups)
    return results


def worst_within_tolerance(per_rank, keys) -> dict:
    """Assert every case (a tuple key of each rank's results) within LOSS_TOL / GRAD_TOL and
    whatever layout checks it carries; the worst of `keys` over cases and ranks."""
    worst = dict.fromkeys(keys, 0.0)
    for rank, results in enumerate(per_rank):
        for key, diff in results.items():
            if not isinstance(key, tuple):
                continue
            assert diff["loss_rel"] < LOSS_TOL, (rank, key, diff)
            assert diff["grad_abs"] < GRAD_TOL, (rank, key, diff)
            assert diff.get("layout", True) and diff.get("follows", True), (rank, key, diff)
            for k in worst:
                worst[k] = max(worst[k], diff.get(k, 0.0))
    return worst


@pytest.mark.timeout(420)
def test_hf_models_under_ulysses_train_like_one_process():
    # ~70 s of CPU over the 4 ranks (about 40 s wall on 2 quiet cores); 212 s wall measured at a
    # load average of 20, hence the limit
    seed = 1234
    per_rank = run_distributed(_rank_main, WORLD, seed, timeout_s=400)
    worst = worst_within_tolerance(per_rank, ("loss_rel", "grad_abs", "grad_rel"))
    for rank, results in enumerate(per_rank):
        masked = results["masked"]
        assert masked["masked"]["loss_rel"] < LOSS_TOL and masked["masked"]["grad_abs"] < GRAD_TOL
        assert masked["tiled"]["loss_abs"] < 1e-6 and masked["tiled"]["grad_abs"] < 1e-6, masked
        assert masked["empty_loss"] == 0.0 and masked["empty_grad"] == 0.0, masked
        assert masked["padded"]["loss_rel"] < LOSS_TOL, masked
        assert masked["padded"]["grad_abs"] < GRAD_TOL, masked
    print(f"worst over families x layouts x ranks: {worst}; masked chunk, tiled, padded: "
          f"{per_rank[0]['masked']}")
    # 3 steps x 2 layers without documents, 2 packed cases x 2 layers with them, on every rank
    calls = [r["stand-in calls"] for r in per_rank]
    assert all(c == (6, 4) for c in calls), calls
    said = per_rank[0]["refusals"]
    assert "6" in said["heads"] and "4" in said["heads"], said
    assert "3" in said["kv heads"], said
    assert "eager" in said["eager"] and "sdpa" in said["eager"], said
    assert "gpt_neox" in said["family"], said
    assert "sliding-window" in said["window"] and "8" in said["window"], said
    assert "already" in said["twice"], said
    assert "without position_ids" in said["positions"], said
    for text in said.values():
        assert "\n" not in text and text.endswith("."), text
