"""A Hugging Face causal-LM batch cut into Ulysses (x ring) sequence chunks (docs/design.md §15).

    shard_batch(batch, sp_group)             the batch every sp rank holds -> this rank's chunk
    shard_batch(batch, sp_group, cp_group)   ... of the Ulysses x ring layout (sp x cp ranks)

Order of work, all on the FULL sequence before any cut (every rank of the context holds the same
full batch):
1. labels shifted over the whole sequence: shift_labels[:, i] = labels[:, i+1], -100 at the end
   of every row, at every packed document's last token (documents start where position_ids are
   0), and where attention_mask marks position i or i+1 as padding;
2. position_ids made when absent: global positions 0..s-1 (a padding attention_mask: the
   positions count the real tokens, cumsum(mask) - 1, and every padding token gets position 0,
   a one-token document of its own, so that no real token attends to it even with left padding);
3. a length that the layout does not divide (sp, or 2 sp cp under a ring: its zigzag chunks) is
   padded at the end (pad=True) with pad_token_id tokens (0 when None), shift_labels -100 (the
   loss ignores them), attention_mask 0, positions continuing the row (causal attention: no real
   token attends to a later pad), or refused (pad=False);
4. the cut. Without a ring (cp = 1), rank r of sp keeps its contiguous chunk [r*s/sp,
   (r+1)*s/sp). Under a ring of cp ranks (megatron_sp.context_parallel.hybrid, Megatron's
   a2a+p2p) with packed documents: the balanced layout (context_parallel.balance; every ring
   rank the same causal attention work, s/cp tokens each, in position order), ring rank j's
   tokens split contiguously over its sp ranks, the layout remembered for the attention
   (megatron_sp.hf.layout). Without documents (or a row that is one document): the sequence
   is cut into 2 cp zigzag chunks, ring rank j owns chunks j and 2cp-1-j (s/cp tokens, in that
   order) and splits them contiguously over its sp ranks:

       s = 16, sp 2 x cp 2: zigzag chunks 0-3 | 4-7 | 8-11 | 12-15 (ring rank 0 1 1 0)
       sp rank 0, cp rank 0: 0 1 2 3      sp rank 1, cp rank 0: 12 13 14 15
       sp rank 0, cp rank 1: 4 5 6 7      sp rank 1, cp rank 1:  8  9 10 11

   input_ids, shift_labels, position_ids (the GLOBAL positions of the kept tokens: RoPE and the
   document starts follow) and attention_mask are cut alike.

`labels` is never returned, so that a model's built-in loss (which would average per rank, the
sp-size over-scaling bug) cannot be used by mistake: use megatron_sp.hf.loss. Other keys of the
batch are dropped. Steps 1-4 are pure (rank, size) arithmetic (`shard_for_rank`), unit-tested
without processes.

That every rank of the context holds the same full batch is checked (same_batch=True): a checksum
of the batch's tensors (`batch_checksum`, O(tokens) integer arithmetic) compared over sp and cp in
one all-reduce of two int64 per group (megatron_sp.hf.comm.same_over_group). Different batches (a
sampler sharded over the world instead of dp) would train on nonsense chunks without an error.
"""
from __future__ import annotations

import torch

from megatron_sp.errors import UserError
from megatron_sp.hf.comm import same_over_group
from megatron_sp.mesh import group_rank, group_size

IGNORE_INDEX = -100
KEYS = ("input_ids", "shift_labels", "position_ids", "attention_mask")


class SequenceParallelError(UserError, ValueError):
    """A model, batch or group that megatron_sp.hf cannot run sequence-parallel as given."""


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] positions -> [b, s] int64 document index per row: a document starts at every
    position 0 (and at each row's first token)."""
    starts = position_ids == 0
    starts[:, 0] = True
    return starts.long().cumsum(dim=1)


def has_documents(position_ids: torch.Tensor) -> bool:
    """True when some row restarts its positions after its first token (packed documents)."""
    return bool((position_ids[:, 1:] == 0).any())


def make_position_ids(input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """[b, s] global positions; with a padding mask, real tokens count 0.. and pads are 0."""
    b, s = input_ids.shape
    if attention_mask is None or bool(attention_mask.all()):
        return torch.arange(s, device=input_ids.device).expand(b, s).clone()   # [b, s]
    real = attention_mask.bool()
    positions = real.long().cumsum(dim=1) - 1                                   # [b, s]
    return positions.masked_fill(~real, 0)


def shift_labels(labels: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """HF labels [b, s] (unshifted) -> shift_labels [b, s]: the target of token i is labels[i+1];
    ignore_index at each row's end, at every document's last token and around padding."""
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    document_end = torch.zeros_like(labels, dtype=torch.bool)
    document_end[:, :-1] = position_ids[:, 1:] == 0          # token i ends a document
    shifted = shifted.masked_fill(document_end, ignore_index)
    if attention_mask is not None:
        pad = ~attention_mask.bool()
        next_pad = torch.zeros_like(pad)
        next_pad[:, :-1] = pad[:, 1:]
        shifted = shifted.masked_fill(pad | next_pad, ignore_index)
    return shifted


def _check(batch: dict) -> tuple[int, int]:
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise SequenceParallelError(
            f"shard_batch: batch['input_ids'] must be a [batch, seq] tensor, got {got}; pass the "
            f"collator's output before any sharding.")
    b, s = ids.shape
    if batch.get("labels") is None and batch.get("shift_labels") is None:
        raise SequenceParallelError(
            "shard_batch: the batch has neither 'labels' nor 'shift_labels'; give the collator's "
            "labels (unshifted, -100 ignored) so that the targets are shifted before the cut.")
    for key in ("labels", "shift_labels", "attention_mask"):
        t = batch.get(key)
        if t is not None and tuple(t.shape) != (b, s):
            raise SequenceParallelError(
                f"shard_batch: batch['{key}'] has shape {tuple(t.shape)} but input_ids is "
                f"{(b, s)}; give every per-token field the same [batch, seq] shape.")
    pos = batch.get("position_ids")
    if pos is not None and (pos.dim() != 2 or pos.shape[1] != s or pos.shape[0] not in (1, b)):
        raise SequenceParallelError(
            f"shard_batch: batch['position_ids'] has shape {tuple(pos.shape)}; it must be "
            f"[{b}, {s}] or [1, {s}] like input_ids {(b, s)}.")
    return b, s


def layout_multiple(sp: int, cp: int = 1) -> int:
    """What the sequence length must be a multiple of: sp chunks, or 2 cp zigzag chunks each cut
    over sp under a ring."""
    return sp if cp == 1 else 2 * sp * cp


def prepare_full(batch: dict, sp: int, *, pad_token_id=None, pad: bool = True,
                 cp: int = 1) -> dict:
    """Steps 1-3 of the module docstring on the full batch: input_ids, shift_labels,
    position_ids (and attention_mask when given), each [b, s'] with s' a multiple of
    layout_multiple(sp, cp)."""
    b, s = _check(batch)
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    pos = batch.get("position_ids")
    pos = make_position_ids(ids, mask) if pos is None else pos.expand(b, s)   # [1|b, s] -> [b, s]
    if batch.get("shift_labels") is not None:     # already shifted by the caller: kept as given
        targets = batch["shift_labels"]
    else:
        targets = shift_labels(batch["labels"], pos, mask)
    full = {"input_ids": ids, "shift_labels": targets, "position_ids": pos}
    if mask is not None:
        full["attention_mask"] = mask
    multiple = layout_multiple(sp, cp)
    extra = (-s) % multiple
    if extra == 0:
        return full
    if not pad:
        what = f"sp = {sp}" if cp == 1 else f"2*sp*cp = 2*{sp}*{cp} (the ring's zigzag chunks)"
        raise SequenceParallelError(
            f"shard_batch: sequence length {s} is not divisible by {what} and pad=False; "
            f"pass pad=True (pads {extra} ignored tokens at the end) or make the collator pad to "
            f"a multiple of {multiple} (pad_to_multiple_of={multiple}).")
    return _pad_end(full, extra, 0 if pad_token_id is None else pad_token_id)


def _pad_end(full: dict, extra: int, pad_token_id: int) -> dict:
    """Append `extra` pad tokens to every row: [b, s] -> [b, s + extra]."""
    def cat(t, tail):
        return torch.cat([t, tail.to(t.dtype)], dim=1)

    ids, pos = full["input_ids"], full["position_ids"]
    b = ids.shape[0]
    tail = torch.arange(1, extra + 1, device=ids.device).expand(b, extra)       # [b, extra]
    out = {"input_ids": cat(ids, torch.full((b, extra), pad_token_id, device=ids.device)),
           "shift_labels": cat(full["shift_labels"],
                               torch.full((b, extra), IGNORE_INDEX, device=ids.device)),
           "position_ids": cat(pos, pos[:, -1:] + tail)}                         # continuing
    if "attention_mask" in full:
        out["attention_mask"] = cat(full["attention_mask"],
                                    torch.zeros(b, extra, device=ids.device))
    return out


def take_chunk(full: dict, rank: int, sp: int, cp: int = 1, cp_rank: int = 0) -> dict:
    """This rank's tokens of every [b, s] field: sp rank `rank`'s contiguous chunk [r*s/sp,
    (r+1)*s/sp) when cp = 1; under a ring, the hybrid layout's tokens of (sp rank, cp rank):
    the balanced layout's with packed documents (remembered for the attention), else the
    zigzag's."""
    s = full["input_ids"].shape[1]
    if cp == 1:
        chunk = s // sp
        cut = slice(rank * chunk, (rank + 1) * chunk)
        return {key: full[key][:, cut].contiguous() for key in KEYS if key in full}  # [b, s/sp]
    from megatron_sp.context_parallel.hybrid import hybrid_positions
    positions = full["position_ids"]
    if has_documents(positions):                  # the balanced layout (megatron_sp.hf.layout)
        from megatron_sp.hf.layout import remember, ring_layout
        layout = ring_layout(document_ids(positions), cp)
        remember(positions, layout)
        n = s // (sp * cp)
        index = layout.positions(cp_rank, positions.device)[:, rank * n:(rank + 1) * n]  # [b, n]
        return {key: full[key].gather(1, index) for key in KEYS if key in full}  # [b, s/(sp cp)]
    index = hybrid_positions(s, sp, cp, rank, cp_rank, device=full["input_ids"].device)   # [n]
    return {key: full[key].index_select(1, index) for key in KEYS if key in full}  # [b, s/(sp cp)]


def shard_for_rank(batch: dict, rank: int, sp: int, *, pad_token_id=None, pad: bool = True,
                   cp: int = 1, cp_rank: int = 0) -> dict:
    """shard_batch as pure arithmetic: sp rank `rank` of `sp` (and ring rank cp_rank of cp), no
    process group."""
    full = prepare_full(batch, sp, pad_token_id=pad_token_id, pad=pad, cp=cp)
    return take_chunk(full, rank, sp, cp, cp_rank)


def count_targets(shard_or_full: dict, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Unmasked targets (shift_labels != ignore_index) of a prepared batch or shard: float32."""
    return (shard_or_full["shift_labels"] != ignore_index).sum().to(torch.float32)


def prepare_shard(batch: dict, sp: int, rank: int, *, cp: int = 1, cp_rank: int = 0,
                  pad_token_id=None, pad: bool = True) -> tuple[dict, torch.Tensor]:
    """(this rank's shard, the unmasked targets of the WHOLE batch): the batch prepared once (the
    Trainer counts the step's targets and shards each micro-batch from the same preparation)."""
    full = prepare_full(batch, sp, pad_token_id=pad_token_id, pad=pad, cp=cp)
    return take_chunk(full, rank, sp, cp, cp_rank), count_targets(full)


def batch_checksum(batch: dict) -> torch.Tensor:
    """An int64 scalar of the per-token fields of a batch (input_ids, labels, shift_labels,
    position_ids, attention_mask when given), their shapes included: each token's value times a
    weight of its place, summed (int64 arithmetic, wrapping), so different values, orders or
    shapes give different sums, equal batches equal ones on every rank and device."""
    total = torch.zeros((), dtype=torch.int64, device=batch["input_ids"].device)
    for i, key in enumerate(("input_ids", "labels", "shift_labels", "position_ids",
                             "attention_mask")):
        t = batch.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        flat = t.reshape(-1).to(device=total.device, dtype=torch.int64)
        place = torch.arange(flat.numel(), device=total.device, dtype=torch.int64)
        weight = (place * 2654435761 + 40503 * (i + 1)) % 2147483647 + 1   # < 2^31, by place
        total = total * 1000003 + (flat * weight).sum() + sum(t.shape) * 97 + t.dim()
    return total


def shard_batch(batch: dict, sp_group, cp_group=None, *, pad_token_id=None, pad: bool = True,
                same_batch: bool = True) -> dict:
    """This rank's chunk of a causal-LM batch (the module docstring says exactly what).

    batch: input_ids [b, s] and labels [b, s] (HF convention: unshifted, -100 ignored; or
    shift_labels already shifted), optional position_ids ([b, s] or [1, s]; restarting at 0 per
    packed document) and attention_mask [b, s] (1 real, 0 padding). Every sp rank passes the same
    full batch. cp_group: the ring (context parallelism past the head count) the model was made
    sequence-parallel with, or None. Returns input_ids, shift_labels, position_ids and
    attention_mask (when given), each [b, s/(sp cp)] (s rounded up to a multiple of sp, or of
    2 sp cp under a ring, when pad=True), and never `labels`: give the model input_ids,
    position_ids (and attention_mask) and compute megatron_sp.hf.loss(logits, shard, sp_group,
    cp_group). Both groups None or of size 1 return the whole (shifted) batch.
    same_batch: check that the sp x cp ranks passed the same batch (an all-reduce of two int64
    over sp, then cp; a SequenceParallelError on every rank if not); False skips it.
    """
    sp, cp = group_size(sp_group), group_size(cp_group)
    try:
        shard, problem = shard_for_rank(batch, group_rank(sp_group), sp, pad_token_id=pad_token_id,
                                        pad=pad, cp=cp, cp_rank=group_rank(cp_group)), None
    except SequenceParallelError as err:    # said after the check, which every rank joins
        shard, problem = None, err
    if same_batch and sp * cp > 1:
        checksum = batch_checksum(batch) if problem is None else torch.zeros((), dtype=torch.int64)
        check_same_batch(checksum, sp_group, cp_group)
    if problem is not None:
        raise problem
    return shard


def check_same_batch(checksum, sp_group, cp_group=None) -> None:
    """Refuse, on every rank, sp x cp ranks whose batches' checksums differ (None: no check)."""
    sp, cp = group_size(sp_group), group_size(cp_group)
    if checksum is not None and sp * cp > 1 and not same_over_group(checksum, (sp_group, cp_group)):
        ranks = f"{sp} sp" if cp == 1 else f"{sp * cp} sp x cp"
        raise SequenceParallelError(
            f"shard_batch: the {ranks} ranks of a data-parallel replica were given different "
            f"batches, but each must pass the same full batch (it keeps its own chunk): shard the "
            f"data over the dp ranks, not the world (e.g. DistributedSampler(dataset, "
            f"num_replicas=dp_size, rank=dp_rank)) so that they load the same batches.")
