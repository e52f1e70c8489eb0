"""The Ulysses x ring hybrid (Megatron-LM's `a2a+p2p`, USP; docs/design.md §14).

The context degree c = a x r: a Ulysses ranks (adjacent ranks, the fast axis, inside a node)
times r ring ranks (stride a). Context rank (in the cp slot) = u + a*j for Ulysses rank u, ring
rank j:

    c = 4 = a 2 x r 2         Ulysses groups (all-to-all)   [0, 1], [2, 3]     (rows)
                              ring groups (p2p)             [0, 2], [1, 3]     (columns)
                     u = 0   u = 1
            j = 0    rank 0  rank 1
            j = 1    rank 2  rank 3

Token layout. The sequence is cut into 2r zigzag chunks (context_parallel.zigzag): ring rank j
owns chunks j and 2r-1-j, s/r tokens in that order; they are split contiguously over its a
Ulysses ranks, n = s/(a r) tokens each (so 2 r a must divide s):

    s = 16, a = 2, r = 2: zigzag chunks of 4 tokens      0-3 | 4-7 | 8-11 | 12-15
                                                         j=0   j=1   j=1    j=0
    ring rank 0 owns [0 1 2 3 | 12 13 14 15] -> rank 0 (u=0): 0 1 2 3    rank 1 (u=1): 12 13 14 15
    ring rank 1 owns [4 5 6 7 |  8  9 10 11] -> rank 2 (u=0): 4 5 6 7    rank 3 (u=1):  8  9 10 11

(hybrid_positions gives a rank's global positions, for RoPE and labels; hybrid_split / hybrid_merge
cut a full [b, s, ...] tensor into a rank's tokens and put every rank's back together.)

Inside hybrid_attention, for h query and g key/value heads (GQA: each kv head replicated a/g times
first when g < a, expand_kv_heads; so g_e = max(g, a) kv heads are sent):

  1. seq->head all-to-all over the Ulysses group (ONE packed call for q, k, v, ulysses.comm):

        Ulysses rank u of ring rank j                 after: every u of ring rank j
        q [b, n, h, d]       (n of j's tokens)        q [b, a n, h/a, d]     (all of j's s/r tokens,
        k, v [b, n, g_e, d]  ---- all-to-all ---->    k, v [b, a n, g_e/a, d]  heads of group u)

  2. ring attention over the ring group (context_parallel.ring): the ranks of one ring share u,
     so they hold the same heads; kv blocks [b, s/r, g_e/a, d] go round the r ring ranks, and the
     queries of j's zigzag chunks see the whole sequence:

        rank u + a*0  --kv-->  rank u + a*1  --kv-->  ...  rank u + a*(r-1)  --kv--> (back to 0)

  3. head->seq all-to-all of the output over the Ulysses group: out [b, a n, h/a, d] ->
     [b, n, h, d], this rank's own n tokens with all heads again.

Autograd flows through all three: the all-to-alls are autograd pairs (each one's backward is the
other), ring attention is an autograd Function (kv blocks and their dk, dv travel the ring again),
and expand_kv_heads' repeat_interleave sums the replicas' gradients.

Communication per rank and layer (elements, N = s tokens, H = h d, g_e = max(g, a);
hybrid_comm_bytes gives the exact bytes, measured equal by comm_stats in the tests):
  all-to-all, forward   (a-1)/a * (2 + 2 g_e/h) * b N H / (a r)    [qkv packed, then out]
  all-to-all, backward  the same (dout, then dq, dk, dv packed)
  ring, forward         2 (r-1) * (g_e/h) * b N H / (a r)          [(r-1) kv blocks]
  ring, backward        2 (r-1) * (g_e/h) * b N H / (a r) in the input dtype, plus
                        2 r * (g_e/h) * b N H / (a r) in fp32 (dk, dv going round and home);
                        nothing when r = 1
a = 1 is ring attention alone, r = 1 Ulysses alone (zigzag with r = 1 is the natural order).
"""
from __future__ import annotations

import torch

from megatron_sp.context_parallel.attention import RingLocalAttention
from megatron_sp.context_parallel.zigzag import zigzag_merge, zigzag_positions
from megatron_sp.mesh import LayoutError, group_size
from megatron_sp.ulysses.attention import UlyssesAttention, check_ulysses_layout


# Layout (pure index arithmetic) -----------------------------------------------------------------

def _check_degrees(a: int, r: int) -> None:
    if a < 1 or r < 1:
        raise LayoutError(f"the Ulysses x ring hybrid needs at least one Ulysses and one ring "
                          f"rank, got a = {a}, r = {r}.")


def check_hybrid_length(seq_len: int, a: int, r: int) -> int:
    """Tokens per rank n = seq_len / (a r); a length that 2 r a does not divide is refused."""
    _check_degrees(a, r)
    n = 2 * r * a
    if seq_len % n != 0:
        fit = max(n, (seq_len // n) * n)
        raise LayoutError(f"the Ulysses x ring layout cuts the sequence in 2*r = {2 * r} zigzag "
                          f"chunks (r = {r} ring ranks) and each ring rank's tokens over a = {a} "
                          f"Ulysses ranks, so a sequence length of {seq_len} does not fit: use a "
                          f"multiple of 2*r*a = {n}, e.g. {fit}.")
    return seq_len // (a * r)


def hybrid_group_ranks(a: int, r: int, offset: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups, ring groups) as lists of ranks, context rank u + a*j (+ offset):
    Ulysses group j = [a j, a j + 1, ..., a j + a-1] (adjacent), ring group u = [u, u + a, ...]."""
    _check_degrees(a, r)
    ulysses = [[offset + u + a * j for u in range(a)] for j in range(r)]
    ring = [[offset + u + a * j for j in range(r)] for u in range(a)]
    return ulysses, ring


def hybrid_positions(seq_len: int, a: int, r: int, ulysses_rank: int, ring_rank: int,
                     device=None) -> torch.Tensor:
    """Global positions [s/(a r)] (int64) of this rank's tokens: slice ulysses_rank of a of the
    ring rank's zigzag tokens (chunk ring_rank, then chunk 2r-1-ring_rank). For RoPE and labels."""
    n = check_hybrid_length(seq_len, a, r)
    if not 0 <= ulysses_rank < a:
        raise ValueError(f"Ulysses rank {ulysses_rank} is outside the Ulysses group of size {a}.")
    zig = zigzag_positions(seq_len, r, ring_rank, device=device)      # [s/r], zigzag order
    return zig[ulysses_rank * n:(ulysses_rank + 1) * n]              # [s/r] -> [n], contiguous


def hybrid_split(t: torch.Tensor, a: int, r: int, ulysses_rank: int, ring_rank: int,
                 dim: int = 1) -> torch.Tensor:
    """This rank's tokens of the full tensor t: [.., s, ..] -> [.., s/(a r), ..] along `dim`
    (a new tensor, in the order of hybrid_positions)."""
    index = hybrid_positions(t.shape[dim], a, r, ulysses_rank, ring_rank, device=t.device)
    return t.index_select(dim, index)


def hybrid_merge(parts, a: int, r: int, dim: int = 1) -> torch.Tensor:
    """The inverse of hybrid_split: every rank's [.., n, ..] in context rank order (u + a*j, as an
    all_gather over the cp group returns them) -> the full [.., a r n, ..] in sequence order."""
    _check_degrees(a, r)
    if len(parts) != a * r:
        raise ValueError(f"hybrid_merge needs one tensor per rank: a*r = {a}*{r} = {a * r} ranks, "
                         f"{len(parts)} tensors.")
    # ring rank j's zigzag tokens: its Ulysses ranks' [.., n, ..] in order -> [.., a n, ..]
    per_ring = [torch.cat(list(parts[a * j:a * (j + 1)]), dim=dim) for j in range(r)]
    return zigzag_merge(per_ring, r, dim=dim)                        # -> [.., s, ..]


# Communication formula --------------------------------------------------------------------------

def hybrid_comm_bytes(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                      a: int, r: int, elem_size: int = 4) -> dict[str, int]:
    """Exact bytes one rank sends per hybrid attention layer, by counter and direction.

    Keys "a2a_forward", "a2a_backward" (comm_stats "sp/all_to_all"), "ring_forward",
    "ring_backward" (comm_stats "cp/ring_p2p"). elem_size: bytes per element of q, k, v (their
    gradients have it too); the ring's travelling dk, dv accumulators are fp32 whatever it is.
    With n = s/(a r) tokens per rank and g_e = max(g, a) kv heads after expand_kv_heads:
      a2a, each direction   (a-1)/a * b n (h + 2 g_e) d  [q, k, v]  +  (a-1)/a * b n h d  [out]
      ring forward          (r-1) kv blocks of 2 * b (a n) (g_e/a) d = 2 (r-1) b n g_e d
      ring backward         the same (r-1) kv blocks, plus r fp32 dk, dv blocks when r > 1
    """
    n = check_hybrid_length(seq_len, a, r)
    check_ulysses_layout(heads, kv_heads, tp=1, sp=a)
    g_e = max(kv_heads, a)
    qkv = batch * n * (heads + 2 * g_e) * head_dim                # packed [b, n, h + 2 g_e, d]
    out = batch * n * heads * head_dim                            # [b, n, h, d]
    a2a = ((a - 1) * qkv // a + (a - 1) * out // a) * elem_size
    block = 2 * batch * n * g_e * head_dim                        # k, v [b, a n, g_e/a, d]
    ring_fwd = (r - 1) * block * elem_size
    ring_bwd = ring_fwd + (r * block * 4 if r > 1 else 0)
    return {"a2a_forward": a2a, "a2a_backward": a2a, "ring_forward": ring_fwd,
            "ring_backward": ring_bwd}


# Attention --------------------------------------------------------------------------------------

def hybrid_attention(q, k, v, ulysses_group, ring_group, *, scale: float | None = None,
                     document_ids=None):
    """Causal attention of this rank's tokens against the whole sequence over a Ulysses x ring mesh.

    q [b, n, h, d], k, v [b, n, g, d]: this rank's n = s/(a r) tokens in the hybrid layout
    (hybrid_split, hybrid_positions), all heads. ulysses_group: the a adjacent ranks sharing this
    rank's ring rank (group rank = Ulysses rank u); ring_group: the r ranks sharing u (group rank
    = ring rank j). Either may be None (size 1). Returns out [b, n, h, d] in q's dtype, same
    tokens. Heads follow Ulysses' rule (check_ulysses_layout): h % a == 0, h % g == 0, and kv
    heads split over a (g % a == 0) or replicated a/g times (a % g == 0); else LayoutError.

    It is the model's own composition, UlyssesAttention(RingLocalAttention(ring), ulysses), as a
    function for the bench and the tests: the seq->head all-to-all gives each rank its ring rank's
    whole zigzag portion (a n = s/r tokens, chunk j then chunk 2r-1-j) for h/a heads, the ring
    attends it against the whole sequence, the head->seq all-to-all returns [b, n, h, d].
    document_ids: the FULL rows' document ids [b, s] (packed documents), as GPTModel gives.
    """
    a, r = group_size(ulysses_group), group_size(ring_group)
    b, n, h, d = q.shape
    if k.shape[:2] != (b, n) or k.shape != v.shape or k.shape[3] != d:
        raise ValueError(f"hybrid attention takes this rank's tokens, q [b, n, h, d] and k, v "
                         f"[b, n, g, d]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}.")
    check_hybrid_length(n * a * r, a, r)             # n even, i.e. 2 r a divides s = n a r
    check_ulysses_layout(h, k.shape[2], tp=1, sp=a)
    core = UlyssesAttention(RingLocalAttention(ring_group), ulysses_group)
    return core(q, k, v, softmax_scale=scale, document_ids=document_ids)
