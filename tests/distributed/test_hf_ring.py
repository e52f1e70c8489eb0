"""megatron_sp.hf under a ring: unmodified transformers causal LMs, Ulysses x ring, train like one
process.

One 4-rank gloo spawn. For tiny random qwen3, llama and mistral models built from configs (2
layers, hidden 64, GQA with 1 or 2 kv heads, sdpa; test_hf_ulysses' FAMILIES), made
sequence-parallel with sequence_parallel(model, sp_group, cp_group) over three meshes
(megatron_sp.mesh.ParallelMesh.from_sizes, rank = sp_rank + cp_rank*sp + dp_rank*sp*cp),
  sp2 x cp2   Ulysses pairs {0,1} {2,3}, rings {0,2} {1,3}: Megatron's a2a+p2p hybrid,
  cp4         ring attention alone over the 4 ranks (kv heads 2 < cp 4: no head rule),
  dp2 x cp2   rings {0,1} {2,3}, dp over them, each replica half of the global batch's rows
              with a different number of masked labels (the loss is the global token mean),
three SGD steps on fresh random batches of 30 tokens (shard_batch pads them to 32, the multiple
2*sp*cp = 8 or 4): the loss equals the unsharded model's (HF's own loss on the whole global
batch) to LOSS_TOL relative, and the gradients averaged over the world equal the unsharded ones
to GRAD_TOL (absolute, fp32), every step; each shard holds the hybrid zigzag layout's tokens
(hybrid_positions) with their global positions.
Packed documents (position_ids restarting at 0; documents crossing the zigzag chunks and the
ring, one-token documents, one spanning every rank) against the block-diagonal reference (each
document alone through the unsharded model), in all three layouts, under the balanced ring
layout shard_batch gives packed documents (megatron_sp.hf.layout; that those rows are laid out
otherwise than the zigzag, more evenly, is checked outside the spawn); packed documents cut by
hand in the zigzag are refused, not guessed. Left and right padding
(attention_mask, on a 30-token batch that shard_batch also pads to 32) equal the unsharded masked
model. tiled_loss equals loss under sp2 x cp2 (value and gradients); loss(num_items_in_batch=N),
N the global count of targets, equals loss(dp_group=dp) under dp2 x cp2 (value and gradients).
Refusals say one sentence: attention dropout under a ring, a sliding window shorter than the
sequence, shard_batch(pad=False) on a length that 2*sp*cp does not divide (the multiple named),
and different batches on the ranks of one context (sp x cp: one odd rank, or the two rings'
halves differing, which sp alone cannot see) raise SequenceParallelError on EVERY rank.
Measured worst differences (fp32): loss 2.0e-7 relative, gradients 1.6e-7 absolute; tiled_loss
against loss: value 0, gradients 1.1e-8; num_items_in_batch against dp_group: 0 and 0. The spawn:
27-38 s wall on 2 cores (62 s on a first, cold run).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_sp.testing import run_distributed
from test_hf_ulysses import (_grad_diff, build, packed_positions, padded_batch, random_batch,
                             reference_packed, reference_step, worst_within_tolerance)

WORLD = 4
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
SEQ, STEPS, LR = 32, 3, 0.5
FAMILIES = ("qwen3", "llama", "mistral")

LAYOUTS = {   # name: ParallelMesh.from_sizes(**sizes) on 4 ranks
    "sp2 x cp2": dict(sp=2, cp=2),
    "cp4": dict(cp=4),
    "dp2 x cp2": dict(cp=2, dp=2),
}

# Documents of the two rows of 32 tokens. At sp2 x cp2 the zigzag chunks are 8 tokens (each
# rank holds half of one), at cp4 4 tokens, at dp2 x cp2 8 tokens: every document boundary below
# falls inside a chunk, and documents run across chunks and across ring ranks.
PACKED = [[5, 14, 9, 4], [17, 15]]
RING = [[1, 6, 1, 9, 14, 1], [32]]        # one-token documents at 0, 7 and the row end (31)
SHORT = [[1] * 8 + [2] * 4 + [16], [32]]  # one-token documents; one spanning every rank
PACKED_CASES = [   # (layout, family, name, documents)
    ("sp2 x cp2", "qwen3", "packed", PACKED), ("sp2 x cp2", "llama", "ring", RING),
    ("cp4", "mistral", "ring", RING), ("cp4", "qwen3", "short", SHORT),
    ("dp2 x cp2", "llama", "packed", PACKED),
]
TRAIN_CASES = ([("sp2 x cp2", f) for f in FAMILIES] + [("cp4", f) for f in FAMILIES]
               + [("dp2 x cp2", "mistral")])


# Helpers on the ranks ------------------------------------------------------------------------

def _average_grads(model):
    """Gradients averaged over the world (dp x cp x sp: every layout here uses all 4 ranks)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(WORLD)


def _pair(family):
    """The unsharded model and a copy with the same weights."""
    ref = build(family)
    model = build(family)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _replica_rows(batch, mesh):
    """The dp replica's rows of the global batch (all of them without dp)."""
    if mesh.dp_size == 1:
        return batch
    rows = batch["input_ids"].shape[0] // mesh.dp_size
    part = slice(rows * mesh.dp_rank, rows * (mesh.dp_rank + 1))
    return {k: v[part] for k, v in batch.items()}


def _layout_ok(shard, mesh, seq, rows):
    """Whether the shard is this rank's hybrid-layout tokens of the padded rows, with their
    global positions (no documents, no mask: positions 0..seq-1)."""
    from megatron_sp.context_parallel.hybrid import hybrid_positions
    index = hybrid_positions(seq, mesh.sp_size, mesh.cp_size, mesh.sp_rank, mesh.cp_rank)
    return (tuple(shard["input_ids"].shape) == (rows, seq // (mesh.sp_size * mesh.cp_size))
            and torch.equal(shard["position_ids"], index.expand(rows, -1))
            and set(shard) == {"input_ids", "shift_labels", "position_ids"})


def _train(mesh, family, seed):
    """Three SGD steps beside the unsharded model, on 30-token batches padded to 32."""
    from megatron_sp import hf
    ref, model = _pair(family)
    hf.sequence_parallel(model, mesh.sp_group, mesh.cp_group)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    worst = dict(loss_rel=0.0, grad_abs=0.0, layout=True)
    for step in range(STEPS):
        batch = random_batch(torch.Generator().manual_seed(seed + 1000 * step), 4, 30)
        batch["labels"][2:, :15] = -100                # replica 1 has fewer tokens than 0
        ref_loss = reference_step(ref, batch)
        shard = hf.shard_batch(_replica_rows(batch, mesh), mesh.sp_group, mesh.cp_group)
        worst["layout"] &= _layout_ok(shard, mesh, SEQ, 4 // mesh.dp_size)
        out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
        value = hf.loss(out.logits, shard, mesh.sp_group, mesh.cp_group, dp_group=mesh.dp_group)
        worst["loss_rel"] = max(worst["loss_rel"],
                                abs(value.item() - ref_loss.item()) / ref_loss.item())
        opt_ref.zero_grad()
        opt.zero_grad()
        ref_loss.backward()
        value.backward()
        _average_grads(model)
        worst["grad_abs"] = max(worst["grad_abs"], _grad_diff(model, ref))
        opt_ref.step()
        opt.step()
    return worst


def _packed(mesh, family, lengths, seed):
    """Packed documents: one step, loss and gradients against the per-document reference."""
    from megatron_sp import hf
    ref, model = _pair(family)
    hf.sequence_parallel(model, mesh.sp_group, mesh.cp_group)
    lengths = lengths * mesh.dp_size                    # each replica gets the two rows
    batch = random_batch(torch.Generator().manual_seed(seed), len(lengths), SEQ)
    batch["position_ids"] = packed_positions(lengths)
    ref_loss = reference_packed(ref, batch, lengths)
    shard = hf.shard_batch(_replica_rows(batch, mesh), mesh.sp_group, mesh.cp_group)
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    value = hf.loss(out.logits, shard, mesh.sp_group, mesh.cp_group, dp_group=mesh.dp_group)
    ref_loss.backward()
    value.backward()
    _average_grads(model)
    return dict(loss_rel=abs(value.item() - ref_loss.item()) / ref_loss.item(),
                grad_abs=_grad_diff(model, ref))


def _padded(mesh, seed):
    """Left and right padding (attention_mask) on 30 tokens (padded to 32 by shard_batch): the
    reference is the unsharded model with the mask and the real tokens' positions. The pads'
    positions 0 make them one-token documents, so the shard follows the balanced layout."""
    from megatron_sp import hf
    from megatron_sp.hf.batch import document_ids
    from megatron_sp.hf.layout import ring_layout
    ref, model = _pair("qwen3")
    hf.sequence_parallel(model, mesh.sp_group, mesh.cp_group)
    # left padding over two chunks, right padding into the added pads
    batch, positions, ref_loss = padded_batch(ref, seed, 30, 11, 19)
    mask = batch["attention_mask"]
    shard = hf.shard_batch(batch, mesh.sp_group, mesh.cp_group)
    full_positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, 3)], dim=1)
    full_mask = torch.cat([mask, torch.zeros(2, 2, dtype=torch.long)], dim=1)
    n = SEQ // (mesh.sp_size * mesh.cp_size)
    index = ring_layout(document_ids(full_positions), mesh.cp_size).positions(mesh.cp_rank)
    index = index[:, mesh.sp_rank * n:(mesh.sp_rank + 1) * n]               # [2, n] of [2, s/cp]
    follows = (torch.equal(shard["position_ids"], full_positions.gather(1, index))
               and torch.equal(shard["attention_mask"].long(), full_mask.gather(1, index)))
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                attention_mask=shard["attention_mask"])
    value = hf.loss(out.logits, shard, mesh.sp_group, mesh.cp_group)
    ref_loss.backward()
    value.backward()
    _average_grads(model)
    return dict(loss_rel=abs(value.item() - ref_loss.item()) / ref_loss.item(),
                grad_abs=_grad_diff(model, ref), follows=follows)


def _same_loss(mesh, family, seed, second):
    """loss() against `second(hidden, model, shard)`, another way to the same loss: the absolute
    differences of the values and of the world-averaged gradients."""
    from megatron_sp import hf
    _, model = _pair(family)
    hf.sequence_parallel(model, mesh.sp_group, mesh.cp_group)
    batch = random_batch(torch.Generator().manual_seed(seed + 11), 4, SEQ)
    batch["labels"][2:, :20] = -100                   # the dp replicas' counts differ
    shard = hf.shard_batch(_replica_rows(batch, mesh), mesh.sp_group, mesh.cp_group)
    values, grads = [], []
    for way in ("loss", "second"):
        model.zero_grad()
        hidden = model.model(input_ids=shard["input_ids"],
                             position_ids=shard["position_ids"]).last_hidden_state
        if way == "loss":
            value = hf.loss(model.lm_head(hidden), shard, mesh.sp_group, mesh.cp_group,
                            dp_group=mesh.dp_group)
        else:
            value = second(hidden, model, shard, batch)
        value.backward()
        _average_grads(model)
        values.append(value.item())
        grads.append([p.grad.clone() for p in model.parameters()])
    return dict(loss_abs=abs(values[0] - values[1]),
                grad_abs=max(float((a - b).abs().max()) for a, b in zip(*grads)))


def _tiled(mesh, seed):
    from megatron_sp import hf

    def second(hidden, model, shard, batch):
        return hf.tiled_loss(hidden, model.lm_head.weight, shard, mesh.sp_group, mesh.cp_group,
                             tiles=3)
    return _same_loss(mesh, "llama", seed, second)


def _num_items(mesh, seed):
    from megatron_sp import hf

    def second(hidden, model, shard, batch):
        count = int((batch["labels"][:, 1:] != -100).sum())      # the global batch's targets
        return hf.loss(model.lm_head(hidden), shard, mesh.sp_group, mesh.cp_group,
                       dp_group=mesh.dp_group, num_items_in_batch=count)
    return _same_loss(mesh, "qwen3", seed, second)


def _said(fn):
    """The SequenceParallelError's message fn raises, or None when it raises nothing."""
    from megatron_sp.hf import SequenceParallelError
    try:
        fn()
    except SequenceParallelError as err:
        return str(err)
    return None


def _refusals(meshes, rank):
    """The one-sentence refusals under a ring (sp2 x cp2 unless said)."""
    from megatron_sp import hf
    mesh = meshes["sp2 x cp2"]
    sp, cp = mesh.sp_group, mesh.cp_group
    said = {}
    said["dropout"] = _said(lambda: hf.sequence_parallel(build("llama", attention_dropout=0.1),
                                                         sp, cp))
    ring = meshes["cp4"]
    said["dropout cp4"] = _said(lambda: hf.sequence_parallel(
        build("qwen3", attention_dropout=0.1), ring.sp_group, ring.cp_group))
    model = hf.sequence_parallel(build("mistral", sliding_window=8), sp, cp)
    shard = hf.shard_batch(random_batch(torch.Generator().manual_seed(3), 1, SEQ), sp, cp)
    said["window"] = _said(lambda: model(input_ids=shard["input_ids"],
                                         position_ids=shard["position_ids"]))
    # packed documents cut by hand in the zigzag (not by shard_batch): the attention cannot
    # tell where the tokens sit, refused rather than guessed
    from megatron_sp.context_parallel.hybrid import hybrid_positions
    zig = hybrid_positions(SEQ, 2, 2, mesh.sp_rank, mesh.cp_rank)
    unknown = packed_positions([[3, 7, 22]])[:, zig]
    plain = hf.sequence_parallel(build("llama"), sp, cp)
    said["not cut by shard_batch"] = _said(lambda: plain(input_ids=zig.unsqueeze(0) % 100,
                                                         position_ids=unknown))
    batch = random_batch(torch.Generator().manual_seed(4), 2, 30)
    said["no pad"] = _said(lambda: hf.shard_batch(batch, sp, cp, pad=False))
    # one rank of the context with another batch; then the rings' halves differing (the sp
    # pairs {0,1} and {2,3} agree inside, so only the check over cp sees it)
    other = random_batch(torch.Generator().manual_seed(5), 2, 30)
    said["odd rank"] = _said(lambda: hf.shard_batch(other if rank == 3 else batch, sp, cp))
    said["odd ring half"] = _said(lambda: hf.shard_batch(other if rank >= 2 else batch, sp, cp))
    # one rank's batch refused on that rank alone (its collator forgot to pad, pad=False): the
    # other ranks are not left waiting in the check's all-reduce; every rank raises
    short = {k: v[:, :30] for k, v in random_batch(torch.Generator().manual_seed(6), 2, 32).items()}
    full = random_batch(torch.Generator().manual_seed(6), 2, 32)
    said["one rank unpadded"] = _said(lambda: hf.shard_batch(short if rank == 1 else full, sp, cp,
                                                             pad=False))
    # a second model from the same config object (a reference model, TRL's ref_model) leaves
    # the first one sequence-parallel (from_config keeps the config it is given); an attention
    # implementation set after sequence_parallel is refused, not run unsharded
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, vocab_size=128,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    first = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    hf.sequence_parallel(first, sp, cp)
    AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    said["second model keeps ours"] = first.config._attn_implementation
    first.config._attn_implementation = "sdpa"
    said["changed after"] = _said(lambda: first(input_ids=shard["input_ids"],
                                                position_ids=shard["position_ids"]))
    # the dp replicas of dp2 x cp2 may (must) hold different batches
    dp = meshes["dp2 x cp2"]
    said["dp replicas"] = _said(lambda: hf.shard_batch(other if dp.dp_rank else batch,
                                                       dp.sp_group, dp.cp_group))
    return said


def _rank_main(rank, world, seed):
    from megatron_sp.mesh import ParallelMesh
    torch.use_deterministic_algorithms(False)
    meshes = {name: ParallelMesh.from_sizes(**sizes) for name, sizes in LAYOUTS.items()}
    results = {}
    for layout, family in TRAIN_CASES:
        results[(family, layout)] = _train(meshes[layout], family, seed)
    for layout, family, name, lengths in PACKED_CASES:
        results[(family, f"{name} documents {layout}")] = _packed(meshes[layout], family,
                                                                    lengths, seed)
    results[("qwen3", "padded sp2 x cp2")] = _padded(meshes["sp2 x cp2"], seed)
    results["tiled"] = _tiled(meshes["sp2 x cp2"], seed)
    results["num_items"] = _num_items(meshes["dp2 x cp2"], seed)
    results["refusals"] = _refusals(meshes, rank)
    return results


@pytest.mark.timeout(420)
def test_hf_models_under_ulysses_x_ring_train_like_one_process():
    # 27-62 s wall measured on 2 cores; the limits leave room for a loaded machine
    seed = 4321
    per_rank = run_distributed(_rank_main, WORLD, seed, timeout_s=400)
    worst = worst_within_tolerance(per_rank, ("loss_rel", "grad_abs"))
    for rank, results in enumerate(per_rank):
        for key in ("tiled", "num_items"):
            assert results[key]["loss_abs"] < 1e-6, (rank, key, results[key])
            assert results[key]["grad_abs"] < 1e-6, (rank, key, results[key])
    print(f"worst over families x layouts x ranks: {worst}; tiled: {per_rank[0]['tiled']}; "
          f"num_items: {per_rank[0]['num_items']}")
    for rank, results in enumerate(per_rank):
        said = results["refusals"]
        assert said["dp replicas"] is None, (rank, said)      # different batches over dp are fine
        assert said["second model keeps ours"] == "megatron_sp_ulysses_sdpa", said
        for name in ("dropout", "dropout cp4", "window", "no pad", "odd rank", "odd ring half",
                     "one rank unpadded", "changed after", "not cut by shard_batch"):
            text = said[name]
            assert text is not None, (rank, name)            # raised on every rank
            assert "\n" not in text and text.endswith("."), (rank, name, text)
        assert "dropout" in said["dropout"] and "0.1" in said["dropout"], said
        assert "cp = 2" in said["dropout"] and "cp = 4" in said["dropout cp4"], said
        assert "sliding-window" in said["window"] and "8" in said["window"], said
        assert "32" in said["window"] and "ring attention" in said["window"], said
        assert "different batches" in said["one rank unpadded"], said
        assert "not cut by megatron_sp.hf.shard_batch" in said["not cut by shard_batch"], said
        assert "'sdpa'" in said["changed after"] and "unsharded" in said["changed after"], said
        assert "30" in said["no pad"] and "2*sp*cp = 2*2*2" in said["no pad"], said
        assert "multiple of 8" in said["no pad"], said
        for name in ("odd rank", "odd ring half"):
            assert "4 sp x cp ranks" in said[name] and "different batches" in said[name], said


def test_packed_rows_are_laid_out_balanced_not_zigzag():
    """Outside the spawn: shard_for_rank's tokens of the packed cases' rows are the balanced
    layout's (context_parallel.balance) over every (sp, cp) rank, each token once, s/(sp cp) a
    rank; the cases' rows are laid out otherwise than the zigzag for each ring size, with a
    causal work balance no worse (and better on some); rows without documents stay the zigzag."""
    from megatron_sp.context_parallel.balance import cp_layout
    from megatron_sp.context_parallel.hybrid import hybrid_positions
    from megatron_sp.hf.batch import document_ids, shard_for_rank
    from megatron_sp.attention.segments import document_bounds
    differs = {}
    for layout, _, _, lengths in PACKED_CASES:
        sp, cp = LAYOUTS[layout].get("sp", 1), LAYOUTS[layout]["cp"]
        positions = packed_positions(lengths)
        rows = positions.shape[0]
        batch = {"input_ids": torch.arange(SEQ).expand(rows, SEQ).clone(),
                 "labels": torch.zeros(rows, SEQ, dtype=torch.long), "position_ids": positions}
        bounds = document_bounds(document_ids(positions))
        balanced = cp_layout("balanced", bounds, rows, SEQ, cp)
        zigzag = cp_layout("zigzag", bounds, rows, SEQ, cp)
        assert balanced.balance() <= zigzag.balance()
        n, seen = SEQ // (sp * cp), []
        for cp_rank in range(cp):
            for sp_rank in range(sp):
                shard = shard_for_rank(batch, sp_rank, sp, cp=cp, cp_rank=cp_rank)
                want = balanced.positions(cp_rank)[:, sp_rank * n:(sp_rank + 1) * n]
                assert torch.equal(shard["input_ids"], want)         # the tokens' global indices
                assert torch.equal(shard["position_ids"], positions.gather(1, want))
                seen.append(shard["input_ids"])
                zig = hybrid_positions(SEQ, sp, cp, sp_rank, cp_rank)
                differs[layout] = differs.get(layout, False) or not torch.equal(
                    shard["input_ids"], zig.expand(rows, -1))
        assert torch.equal(torch.cat(seen, dim=1).sort(dim=1).values,
                           torch.arange(SEQ).expand(rows, SEQ))
    assert differs == {layout: True for layout, *_ in PACKED_CASES}, differs
    plain = {"input_ids": torch.arange(SEQ).expand(2, SEQ).clone(),
             "labels": torch.zeros(2, SEQ, dtype=torch.long)}
    shard = shard_for_rank(plain, 1, 2, cp=2, cp_rank=1)
    assert torch.equal(shard["input_ids"], hybrid_positions(SEQ, 2, 2, 1, 1).expand(2, -1))
