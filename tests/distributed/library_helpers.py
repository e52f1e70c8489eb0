"""Helpers only the tests use, built from the library's own pieces (issue 49: no test hooks in the
production code). Each was a function of the library that nothing but tests called:

- `ring_block_mask_mod`, `flex_attention_with_lse`: FlexAttention on one ring block pair in
  attention_with_lse's form (were in megatron_sp/attention/flex.py; the ring itself uses
  attention/lse.py's kernels);
- `check_seq_divisible`: megatron_sp.mesh.sequence_layout_problem raised as a LayoutError (was in
  megatron_sp/ulysses/attention.py);
- `gather_full`: a tp-sharded parameter's full tensor on every rank (was in
  megatron_sp/tensor_parallel/layers.py);
- `read_full_tensors`: every stored tensor of a checkpoint at its full shape, in one process (was
  in megatron_sp/checkpointing/pretrained.py; load_pretrained is the library's reader).

The spawned ranks import this module too: tests/conftest.py keeps this folder on sys.path.
"""
from __future__ import annotations

import math

import torch

from megatron_sp.attention import flex
from megatron_sp.checkpointing import pretrained
from megatron_sp.checkpointing.format import TRACKER_FILENAME, CheckpointError, Shard
from megatron_sp.checkpointing.io import dcp_load, resolve_checkpoint
from megatron_sp.mesh import LayoutError, sequence_layout_problem
from megatron_sp.tensor_parallel.layers import gather_full_like


# FlexAttention on a ring block pair ---------------------------------------------------------------

def ring_block_mask_mod(q_offset: int, k_offset: int, causal: bool, doc_q=None, doc_k=None):
    """A ring block pair: queries at global positions q_offset + i, keys at k_offset + j; causal
    compares the global positions; doc_q [b, sq] / doc_k [b, sk]: the pair's document indices
    (None: no documents). None when nothing is masked (a full pair)."""
    mods = []
    if causal:
        def causal_at_offsets(b, h, q_idx, kv_idx):
            return q_idx + q_offset >= kv_idx + k_offset
        mods.append(causal_at_offsets)
    if doc_q is not None:
        mods.append(flex.document_mask_mod(doc_q, doc_k))
    return flex._combine(mods)


def flex_attention_with_lse(q, k, v, *, causal: bool, scale: float | None = None,
                            q_offset: int = 0, k_offset: int = 0, doc_q=None, doc_k=None,
                            block_mask=None):
    """One ring block pair through FlexAttention, in attention_with_lse's form (attention/lse.py).

    q [b, sq, h, d], k, v [b, sk, g, d] (h % g == 0) -> (out [b, sq, h, d] in q's dtype, lse
    [b, h, sq] fp32; a row that sees no key has lse = -inf and out = 0), ready for merge_partials.
    causal compares global positions q_offset + i >= k_offset + j (offsets equal: the diagonal
    block); doc_q [b, sq] / doc_k [b, sk]: document indices of the pair's tokens (None: no
    documents). block_mask: a prebuilt one (e.g. cached per step); else built here.
    """
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if block_mask is None:
        mod = ring_block_mask_mod(q_offset, k_offset, causal, doc_q, doc_k)
        if mod is not None:
            block_mask = flex.build_block_mask(mod, b if doc_q is not None else None, sq, sk,
                                               q.device)
    out, lse = flex._flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [b, n, s, d]
                          block_mask, scale, return_lse=True)
    return out.transpose(1, 2), lse.float()          # [b, h, sq, d] -> [b, sq, h, d]; [b, h, sq]


# Layout check -------------------------------------------------------------------------------------

def check_seq_divisible(seq_length: int, sp: int, tp: int = 1, sequence_parallel: bool = False):
    """Refuse a sequence length that sp (times tp with --sequence-parallel) does not divide."""
    problem = sequence_layout_problem(seq_length, sp, tp, sequence_parallel, what="sequence length")
    if problem:
        raise LayoutError(problem)


# Tensor parallelism -------------------------------------------------------------------------------

def gather_full(param: torch.Tensor, group) -> torch.Tensor:
    """All-gather the shards of `param` over the tp `group` into the full tensor (no autograd).

    Every rank of the group gets the full tensor. For a gradient use `gather_full_like(p.grad, p,
    group)`.
    """
    return gather_full_like(param.detach(), param, group)


# Checkpoints --------------------------------------------------------------------------------------

def read_full_tensors(path: str, prefix: str = "model/",
                      verify: bool = True) -> dict[str, torch.Tensor]:
    """Every stored tensor under `prefix` at its full stored shape (one process; no process group).

    Fused projections come back as [c, n/c, ...] and vocabulary rows unpadded (the stored shapes).
    `verify`: check the files against the checksums recorded at save first (the checks
    load_pretrained runs, through the same checkpointing/pretrained.py helpers).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    folder = resolve_checkpoint(path)
    if folder is None:
        raise CheckpointError(f"{path} holds no checkpoint ({TRACKER_FILENAME} is missing).")
    _, checks, advice = pretrained._open_local(folder, verify)
    md = pretrained._read_dcp_metadata(folder, advice)
    state = {k: Shard(torch.empty(m.size, dtype=m.properties.dtype), m.size,
                      torch.Size([0] * len(m.size)))
             for k, m in md.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    dcp_load(state, folder, local=True, verify=checks, advice=advice)
    return {k[len(prefix):]: v.local for k, v in state.items()}
