"""Expert parallelism's token dispatch (Megatron's MoEAlltoAllTokenDispatcher, tp = 1).

The ep ranks of one group hold E/ep experts each (rank r: global experts [r*E/ep, (r+1)*E/ep)).
After `permute` a rank's rows are grouped by global expert, so they are already grouped by
destination rank:

    permuted [N, H] (experts 0..E-1)   tokens_per_expert [E] -> counts [ep, E/ep] (dest, local e)
    counts exchange   all_to_all_single over ep, int64: received [ep, E/ep] (source, local e)
    dispatch          all_to_all_single of the rows, input splits = rows per destination,
                      output splits = rows per source -> [R, H] in (source, local expert) order
    regroup           stable argsort by local expert -> [R, H] grouped by local expert,
                      local tokens_per_expert [E/ep] = received.sum(0)
    experts           -> [R, H]; un-regroup (the inverse permutation) -> (source, local e) order
    combine           all_to_all_single back, the splits swapped -> [N, H] in permute's order

The exchanges themselves (the counts and the rows, each row all-to-all an autograd pair whose
backward is the same exchange with the splits swapped, and their counting) are moe/comm.py's;
`dispatch_bytes` is the formula of what they count.
"""
from __future__ import annotations

import torch

from megatron_sp.mesh import group_size
from megatron_sp.moe.comm import all_to_all_rows, exchange_counts


def regroup_order(received: torch.Tensor) -> torch.Tensor:
    """The stable order [R] that takes rows in (source, local expert) order, received [ep, E/ep]
    counts, to local-expert order (sources in order within each expert); no dense mask."""
    ep, local = received.shape
    expert_of_block = torch.arange(local, device=received.device).repeat(ep)   # [ep*E/ep]
    expert_of_row = torch.repeat_interleave(expert_of_block, received.reshape(-1))   # [R]
    return torch.argsort(expert_of_row, stable=True)


def dispatch_experts_combine(permuted: torch.Tensor, tokens_per_expert: torch.Tensor, experts,
                             group) -> torch.Tensor:
    """permuted [N, H] grouped by global expert, tokens_per_expert [E] -> the experts' output
    [N, H] in the same order, the experts (E/ep local ones, `experts(rows, counts)`) run on the
    ep rank that holds them (module docstring)."""
    send = tokens_per_expert.to(torch.int64).reshape(group_size(group), -1)   # [ep, E/ep]
    received = exchange_counts(tokens_per_expert, group)                      # [ep, E/ep]
    input_splits = send.sum(dim=1).tolist()        # rows to each destination (host sync)
    output_splits = received.sum(dim=1).tolist()   # rows from each source
    rows = all_to_all_rows(permuted, group, input_splits, output_splits)  # [R, H]
    order = regroup_order(received)                                           # [R]
    out = experts(rows[order], received.sum(dim=0))                           # [R, H] by expert
    out = out[torch.argsort(order)]                                           # (source, e) order
    return all_to_all_rows(out, group, output_splits, input_splits)       # [N, H]


def dispatch_bytes(counts: torch.Tensor, ep_rank: int, hidden_size: int, element_size: int,
                   backward: bool = True) -> int:
    """comm.ROWS_KIND bytes of one MoE layer on ep rank `ep_rank`, from every ep rank's routed rows per
    global expert, counts [ep, E] (row s: source s's tokens_per_expert): forward the dispatch sends
    the rows bound for other ranks' experts and the combine returns the rows received from other
    ranks; backward the same two again, reversed."""
    ep, num_experts = counts.shape
    local = num_experts // ep
    mine = slice(ep_rank * local, (ep_rank + 1) * local)
    sent = int(counts[ep_rank].sum() - counts[ep_rank, mine].sum())
    received = int(counts[:, mine].sum() - counts[ep_rank, mine].sum())
    return (2 if backward else 1) * (sent + received) * hidden_size * element_size
