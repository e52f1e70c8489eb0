"""Distributed optimizer benchmark on CPU (gloo): per-rank model-state bytes and step time.

python bench/distributed_optimizer.py [--steps 6] [--hidden 128] [--layers 4]

For dp x sp = 1, 2 (dp2) and 4 (sp2 x dp2), three trainers of the same Llama-style model run in one
process per rank, their steps interleaved (unsharded AdamW, --use-distributed-optimizer, and with
--optimizer-cpu-offload), so load from other work on the machine hits all three alike. Rows: the
bytes each rank holds, measured from the tensors, next to DESIGN 11's prediction, and the median step
time relative to unsharded in the same layout. On CPU "host" and "device" are the same memory: the
offload row shows the split, not a saving, and its time the extra copies.
"""
import argparse
import statistics
import time

import torch

from megatron_sp.mesh import ParallelMesh
from megatron_sp.models import GPTModel, preset
from megatron_sp.models.init import init_parameters
from megatron_sp.optimizer import LRScheduler, build_optimizer
from megatron_sp.sharding.distributed_optimizer import DistributedOptimizer
from megatron_sp.testing import run_distributed
from megatron_sp.training import Trainer

MODES = ("unsharded", "distributed optimizer", "distributed optimizer + offload")


def _trainer(mesh, cfg, mode, seq, global_batch):
    chunk = GPTModel(cfg, mesh)
    init_parameters(chunk, seed=3)
    if mode == "unsharded":
        opt = build_optimizer([chunk], lr=1e-4)
    else:
        opt = DistributedOptimizer([chunk], mesh, lr=1e-4, cpu_offload=mode.endswith("offload"))
    return Trainer([chunk], opt, LRScheduler(opt, 1e-4, 1e-5, 0, 100), mesh,
                   global_batch_size=global_batch, micro_batch_size=1, seq_length=seq)


def _bytes(trainer):
    """(device, host) model-state bytes of this rank, measured from the tensors."""
    opt = trainer.optimizer
    if isinstance(opt, DistributedOptimizer):
        got = opt.model_state_bytes()
        return sum(got["device"].values()), sum(got["host"].values())
    nbytes = sum(p.numel() * p.element_size() * 2 for p in trainer.params)     # weights + grads
    nbytes += sum(t.numel() * t.element_size() for st in opt.state.values()
                  for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
    return nbytes, 0


def _predicted(mode, p_r, n):
    """DESIGN 11 (fp32 parameters: no separate master on the device)."""
    if mode == "unsharded":
        return 16 * p_r, 0
    if mode.endswith("offload"):
        return 8 * p_r, 16 * p_r / n
    return 8 * p_r + 8 * p_r / n, 0


def bench(rank, world, sizes, args):
    torch.manual_seed(0)
    cfg = preset("llama-tiny", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                 num_query_groups=4, ffn_hidden_size=4 * args.hidden, vocab_size=1024)
    mesh = ParallelMesh.from_sizes(**sizes)
    global_batch = 4
    trainers = {m: _trainer(mesh, cfg, m, args.seq, global_batch) for m in MODES}
    gen = torch.Generator().manual_seed(1)
    times = {m: [] for m in MODES}
    for step in range(args.steps + 1):
        tokens = torch.randint(0, 1000, (global_batch, args.seq + 1), generator=gen)
        mb_count = trainers[MODES[0]].num_micro_batches
        mbs = [{"tokens": tokens[i:i + 1, :-1], "labels": tokens[i:i + 1, 1:],
                "loss_mask": torch.ones(1, args.seq),
                "position_ids": torch.arange(args.seq)[None]}
               for i in range(mesh.dp_rank, global_batch, mesh.dp_size)][:mb_count]
        for mode in MODES:
            t0 = time.perf_counter()
            trainers[mode].train_step(mbs)
            if step:                      # the first step allocates the Adam state
                times[mode].append(time.perf_counter() - t0)
    p_r = sum(p.numel() for p in trainers[MODES[0]].params)
    n = mesh.dp_size * mesh.sp_size
    return [(mode, p_r, n, _bytes(trainers[mode]), _predicted(mode, p_r, n),
             statistics.median(times[mode]) / statistics.median(times[MODES[0]])) for mode in MODES]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    print("| dp x sp | mode | P_r | device MB (measured / DESIGN 11) | host MB (measured / DESIGN 11) "
          "| step time vs unsharded |")
    print("|---|---|---|---|---|---|")
    for world, sizes, label in ((1, {}, "1"), (2, {}, "2 (dp2)"), (4, {"sp": 2}, "4 (sp2 x dp2)")):
        rows = run_distributed(bench, world, sizes, args, timeout_s=900)[0]
        for mode, p_r, n, (dev, host), (pdev, phost), ratio in rows:
            print(f"| {label} | {mode} | {p_r} | {dev / 2**20:.3f} / {pdev / 2**20:.3f} | "
                  f"{host / 2**20:.3f} / {phost / 2**20:.3f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
