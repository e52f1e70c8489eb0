"""megatron_sp.hf.batch as pure (rank, size) arithmetic, and the sp = 1 path of the package
(no process group): shifted labels with document ends and padding masked, positions made when
absent, padding to a multiple of sp or the refusal, contiguous chunks that rebuild the batch,
no `labels` key; under a ring (cp > 1) the hybrid zigzag layout's shards, whose union
(hybrid_merge) is the batch padded to a multiple of 2 sp cp, with global positions, labels shifted
before the cut and the padding mask cut alike; sequence_parallel(model, None) is a no-op whose
loss is transformers' own."""
from __future__ import annotations

import pytest
import torch

from megatron_sp.hf import SequenceParallelError, loss, sequence_parallel, shard_batch, tiled_loss
from megatron_sp.hf.batch import document_ids, prepare_full, shard_for_rank, take_chunk

IGNORE = -100


def _batch(seed, b=2, s=12, vocab=50):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=gen)
    labels = ids.clone()
    labels[torch.rand(b, s, generator=gen) < 0.2] = IGNORE
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("seed", [0, 1])
def test_shift_and_chunks_rebuild_the_shifted_batch(seed):
    batch = _batch(seed)
    for sp in (1, 2, 3, 4):
        shards = [shard_for_rank(batch, r, sp) for r in range(sp)]
        for shard in shards:
            assert set(shard) == {"input_ids", "shift_labels", "position_ids"}
            assert shard["input_ids"].shape == (2, 12 // sp)
        ids = torch.cat([s["input_ids"] for s in shards], dim=1)
        shifted = torch.cat([s["shift_labels"] for s in shards], dim=1)
        positions = torch.cat([s["position_ids"] for s in shards], dim=1)
        assert torch.equal(ids, batch["input_ids"])
        assert torch.equal(shifted[:, :-1], batch["labels"][:, 1:])
        assert (shifted[:, -1] == IGNORE).all()
        assert torch.equal(positions, torch.arange(12).expand(2, 12))


def test_packed_documents_mask_each_document_end():
    batch = _batch(2, b=1, s=10)
    batch["labels"] = batch["input_ids"].clone()
    batch["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])
    full = prepare_full(batch, 2)
    ends = [2, 4, 9]                                   # last token of each document
    for i in range(10):
        expected = IGNORE if i in ends else int(batch["labels"][0, i + 1])
        assert int(full["shift_labels"][0, i]) == expected, i
    assert torch.equal(full["position_ids"], batch["position_ids"])    # kept as given
    assert document_ids(full["position_ids"]).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3, 3, 3]]


def test_padding_mask_makes_positions_and_masks_targets():
    batch = _batch(3, b=2, s=6)
    batch["labels"] = batch["input_ids"].clone()
    batch["attention_mask"] = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    full = prepare_full(batch, 2)
    assert full["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 0, 0]]
    shifted = full["shift_labels"]
    assert shifted[0, :2].tolist() == [IGNORE, IGNORE]           # pads predict nothing
    assert shifted[0, 2:5].tolist() == batch["labels"][0, 3:6].tolist()
    assert shifted[1, :3].tolist() == batch["labels"][1, 1:4].tolist()
    assert shifted[1, 3:].tolist() == [IGNORE] * 3               # next is a pad / pads
    shard = shard_for_rank(batch, 1, 2)
    assert torch.equal(shard["attention_mask"], batch["attention_mask"][:, 3:])


def test_length_not_divisible_is_padded_or_refused():
    batch = _batch(4, b=2, s=10)
    shards = [shard_for_rank(batch, r, 4, pad_token_id=7) for r in range(4)]   # 10 -> 12
    ids = torch.cat([s["input_ids"] for s in shards], dim=1)
    shifted = torch.cat([s["shift_labels"] for s in shards], dim=1)
    positions = torch.cat([s["position_ids"] for s in shards], dim=1)
    assert ids.shape == (2, 12) and (ids[:, 10:] == 7).all()
    assert (shifted[:, 9:] == IGNORE).all()                       # the end and both pads
    assert torch.equal(positions, torch.arange(12).expand(2, 12))  # pads continue the row
    with pytest.raises(SequenceParallelError, match=r"10 is not divisible by sp = 4.*pad=True"):
        shard_for_rank(batch, 0, 4, pad=False)


def test_bad_batches_are_refused_in_one_sentence():
    with pytest.raises(SequenceParallelError, match="neither 'labels' nor 'shift_labels'"):
        shard_for_rank({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, 0, 2)
    with pytest.raises(SequenceParallelError, match=r"position_ids.*\[1, 4\]"):
        shard_for_rank({"input_ids": torch.zeros(1, 4, dtype=torch.long),
                        "labels": torch.zeros(1, 4, dtype=torch.long),
                        "position_ids": torch.zeros(1, 3, dtype=torch.long)}, 0, 2)


def test_take_chunk_is_contiguous_rank_arithmetic():
    full = {"input_ids": torch.arange(16).view(2, 8), "shift_labels": torch.arange(16).view(2, 8),
            "position_ids": torch.arange(16).view(2, 8)}
    assert take_chunk(full, 2, 4)["input_ids"].tolist() == [[4, 5], [12, 13]]


def _tiny_llama(seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=50, loss_type="ForCausalLM")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def test_sp_group_of_one_is_a_no_op_with_the_exact_loss():
    """No group: the model keeps its attention; loss and tiled_loss equal transformers' loss."""
    model = _tiny_llama()
    assert sequence_parallel(model, None) is model
    assert model.config._attn_implementation == "sdpa"
    batch = _batch(5, b=2, s=12)
    reference = model(**batch).loss
    shard = shard_batch(batch, None)
    assert "labels" not in shard
    hidden = model.model(input_ids=shard["input_ids"],
                         position_ids=shard["position_ids"]).last_hidden_state
    value = loss(model.lm_head(hidden), shard, None)
    tiled = tiled_loss(hidden, model.lm_head.weight, shard, None, tiles=3)
    torch.testing.assert_close(value, reference, rtol=1e-6, atol=0)
    torch.testing.assert_close(tiled, reference, rtol=1e-6, atol=0)
    empty = shard_batch(dict(batch, labels=torch.full_like(batch["labels"], IGNORE)), None)
    zero = loss(model(input_ids=empty["input_ids"]).logits, empty, None)
    zero.backward()
    assert zero.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_unknown_family_and_eager_refused_without_processes():
    from transformers import AutoConfig, AutoModelForCausalLM
    model = _tiny_llama()
    model.config._attn_implementation = "eager"
    with pytest.raises(SequenceParallelError, match="eager attention.*attn_implementation='sdpa'"):
        sequence_parallel(model, None)
    config = AutoConfig.for_model("gpt_neox", hidden_size=32, num_attention_heads=4,
                                  num_hidden_layers=1, intermediate_size=64, vocab_size=50)
    with pytest.raises(SequenceParallelError, match="not 'gpt_neox'"):
        sequence_parallel(AutoModelForCausalLM.from_config(config), None)
    moe = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_attention_heads=4,
                               num_key_value_heads=2, num_hidden_layers=1, intermediate_size=64,
                               moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                               vocab_size=50, output_router_logits=True)
    with pytest.raises(SequenceParallelError, match="output_router_logits=True would add a router "
                                                    "loss over each rank's own tokens only"):
        sequence_parallel(AutoModelForCausalLM.from_config(moe, attn_implementation="sdpa"), None)


def test_batch_checksum_tells_batches_apart():
    """What shard_batch compares over the sp group: equal batches give equal sums, another
    value, another row order, labels, positions or another shape a different one."""
    from megatron_sp.hf.batch import batch_checksum
    batch = _batch(0)
    same = {k: v.clone() for k, v in batch.items()}
    assert batch_checksum(batch) == batch_checksum(same)
    others = [_batch(1), {k: v.flip(0) for k, v in batch.items()},
              dict(batch, labels=batch["labels"].roll(1, dims=1)),
              dict(batch, position_ids=torch.arange(12).expand(2, 12)),
              {k: v.reshape(4, 6) for k, v in batch.items()}]
    sums = {int(batch_checksum(b)) for b in [batch] + others}
    assert len(sums) == len(others) + 1
    assert shard_batch(batch, None, same_batch=True)["input_ids"].shape == (2, 12)   # sp 1


# Under a ring (cp > 1): the Ulysses x ring hybrid layout, pure arithmetic ----------------------

RING_LAYOUTS = [(1, 2), (2, 2), (1, 4), (2, 3), (4, 2)]     # (sp, cp)


class _Shards(list):
    """Shards in context-rank order, with `at`: each one's tokens' places in the prepared rows."""
    at: list


def _ring_shards(batch, sp, cp, **kw):
    """Every rank's shard in context-rank order u + sp*j (what an all_gather over sp x cp gives);
    .at: their tokens' places in the prepared rows (the zigzag's, or with packed documents the
    balanced layout's), cut by take_chunk from the same positions."""
    full = prepare_full(batch, sp, cp=cp, **kw)
    b, s = full["input_ids"].shape
    where = {"input_ids": torch.arange(s).expand(b, s), "position_ids": full["position_ids"]}
    shards = _Shards(shard_for_rank(batch, u, sp, cp=cp, cp_rank=j, **kw)
                     for j in range(cp) for u in range(sp))
    shards.at = [take_chunk(where, u, sp, cp, j)["input_ids"]                  # [b, n] each
                 for j in range(cp) for u in range(sp)]
    return shards


def _merged(shards, key, sp, cp):
    """The shards' `key` put back in sequence order: [b, s]."""
    at = torch.cat(shards.at, dim=1)                                         # [b, s]
    values = torch.cat([s[key] for s in shards], dim=1)                      # [b, s]
    merged = torch.empty_like(values).scatter_(1, at, values)
    assert torch.equal(at.sort(dim=1).values, torch.arange(at.shape[1]).expand_as(at))
    return merged


def test_hybrid_layout_is_the_docstring_example():
    """s = 16, sp 2 x cp 2: (u, j) = (0, 0) 0-3, (1, 0) 12-15, (0, 1) 4-7, (1, 1) 8-11."""
    batch = {"input_ids": torch.arange(16).view(1, 16), "labels": torch.arange(16).view(1, 16)}
    got = [s["input_ids"].tolist() for s in _ring_shards(batch, 2, 2)]
    assert got == [[[0, 1, 2, 3]], [[12, 13, 14, 15]], [[4, 5, 6, 7]], [[8, 9, 10, 11]]]
    got = [s["input_ids"].tolist() for s in _ring_shards(batch, 1, 4)]     # ring alone
    assert got == [[[0, 1, 14, 15]], [[2, 3, 12, 13]], [[4, 5, 10, 11]], [[6, 7, 8, 9]]]


@pytest.mark.parametrize("sp, cp", RING_LAYOUTS)
def test_ring_shards_rebuild_the_padded_batch(sp, cp):
    """The union of every rank's tokens is the whole batch padded to a multiple of 2 sp cp (21 ->
    24 or 32); each rank's position_ids are the global positions of the tokens it kept;
    shift_labels were shifted over the whole row before the cut."""
    from megatron_sp.context_parallel.hybrid import hybrid_positions
    from megatron_sp.hf.batch import layout_multiple
    batch = _batch(6, b=3, s=21)
    multiple = 2 * sp * cp
    assert layout_multiple(sp, cp) == multiple and layout_multiple(sp) == sp    # no ring: sp
    s = -(-21 // multiple) * multiple
    shards = _ring_shards(batch, sp, cp, pad_token_id=9)
    for shard in shards:
        assert set(shard) == {"input_ids", "shift_labels", "position_ids"}
        assert shard["input_ids"].shape == (3, s // (sp * cp))
    ids = _merged(shards, "input_ids", sp, cp)
    assert ids.shape == (3, s)
    assert torch.equal(ids[:, :21], batch["input_ids"]) and (ids[:, 21:] == 9).all()
    for (j, u), shard in zip([(j, u) for j in range(cp) for u in range(sp)], shards):
        kept = hybrid_positions(s, sp, cp, u, j)
        assert torch.equal(shard["position_ids"], kept.expand(3, -1))           # global
        assert torch.equal(shard["input_ids"], ids[:, kept])
    assert torch.equal(_merged(shards, "position_ids", sp, cp), torch.arange(s).expand(3, s))
    shifted = _merged(shards, "shift_labels", sp, cp)
    assert torch.equal(shifted[:, :20], batch["labels"][:, 1:])              # shifted, then cut
    assert (shifted[:, 20:] == IGNORE).all()                                 # row end and pads


@pytest.mark.parametrize("sp, cp", [(2, 2), (1, 4)])
def test_ring_shards_keep_document_ends_and_padding_masked(sp, cp):
    """Packed documents whose ends fall on other ranks than their next token: each document's
    last token is -100 wherever the cut puts it; a padding mask is cut with the tokens, and the
    pads the layout adds continue the row's positions."""
    b, s = 2, 14                                                      # padded to 16
    batch = _batch(7, b=b, s=s)
    batch["labels"] = batch["input_ids"].clone()                      # every target unmasked
    lengths = [[3, 1, 5, 5], [1, 13]]
    batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row])
                                         for row in lengths])
    shards = _ring_shards(batch, sp, cp)
    shifted = _merged(shards, "shift_labels", sp, cp)
    positions = _merged(shards, "position_ids", sp, cp)
    assert torch.equal(positions[:, :s], batch["position_ids"])
    assert torch.equal(positions[:, s:], positions[:, s - 1:s] + torch.arange(1, 3))
    for row, docs in enumerate(lengths):
        ends = set(torch.tensor(docs).cumsum(0).sub(1).tolist())
        for i in range(16):
            expected = (IGNORE if i in ends or i >= s - 1
                        else int(batch["labels"][row, i + 1]))
            assert int(shifted[row, i]) == expected, (row, i)
    # a padding mask (left on row 0, right on row 1): cut alike, its pads masked as targets
    masked = _batch(8, b=b, s=s)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, 9:] = 0
    masked["attention_mask"] = mask
    shards = _ring_shards(masked, sp, cp)
    full_mask = _merged(shards, "attention_mask", sp, cp)
    assert torch.equal(full_mask[:, :s].long(), mask) and not full_mask[:, s:].any()
    shifted = _merged(shards, "shift_labels", sp, cp)
    assert (shifted[0, :5] == IGNORE).all() and (shifted[1, 8:] == IGNORE).all()
    assert torch.equal(shifted[0, 5:s - 1], masked["labels"][0, 6:])
    positions = _merged(shards, "position_ids", sp, cp)
    assert positions[0, :s].tolist() == [0] * 5 + list(range(9))
    assert positions[1, :s].tolist() == list(range(9)) + [0] * 5


def test_ring_length_refused_without_padding_names_the_multiple():
    batch = _batch(9, b=1, s=12)
    with pytest.raises(SequenceParallelError,
                       match=r"12 is not divisible by 2\*sp\*cp = 2\*2\*2 .*multiple of 8"):
        shard_for_rank(batch, 0, 2, cp=2, cp_rank=1, pad=False)
    shard = shard_for_rank(batch, 0, 1, cp=3, cp_rank=2, pad=False)    # 12 = 2*1*3*2: fits
    assert shard["position_ids"].tolist() == [[4, 5, 6, 7]]
    # sp 4 alone divides 12, the same four ranks as sp 2 x cp 2 do not: the ring's multiple
    assert shard_for_rank(batch, 3, 4, pad=False)["input_ids"].shape == (1, 3)
