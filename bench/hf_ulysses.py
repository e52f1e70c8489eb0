#!/usr/bin/env python
"""Hugging Face models under Ulysses, a ring, and both: megatron_sp.hf against DeepSpeed's
UlyssesSPAttentionHF (ALST), at the same world size.

On W gloo ranks (spawned on this CPU), a tiny random Qwen3 and Llama (built from configs, same
weights for every stack), one sequence of --seq tokens, one training step (forward, the exact loss
megatron_sp.hf.loss, backward). Per world W, the stacks (all on the same W ranks, same batch):

  ALST sp W    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", W, ...): DeepSpeed's
               wrapper in transformers' attention registry (its own all-to-alls and a per-layer
               all-gather of the position ids); "not installed" when deepspeed does not import
  ours sp W    megatron_sp.hf.sequence_parallel(model, sp_group): our packed q/k/v seq->head
               all-to-all and the head->seq one around transformers' sdpa
  ours cp W    sequence_parallel(model, None, cp_group): ring attention over W ranks (zigzag)
  ours sp a x cp r (a r = W)   Ulysses over sp a around a ring of r (Megatron's a2a+p2p)
  torch CP     torch.distributed.tensor.experimental.context_parallel (what accelerate's
               ParallelismConfig(cp_size=...) runs, under FSDP2 on CUDA): tried on CPU gloo; with
               torch 2.13 its sdpa dispatch has no sharding strategy for the CPU kernel
               (aten._scaled_dot_product_flash_attention_for_cpu), so the row says "not run"

Groups from megatron_sp.mesh.ParallelMesh.from_sizes(sp=a, cp=r). Per rank: the bytes this rank
SENDS per decoder layer (forward + backward of one step), counted by wrapping torch.distributed
for every stack alike: all_to_all_single ((p-1)/p of the buffer, the figure of
megatron_sp/comm_stats.py), batch_isend_irecv (the isend ops' tensors: the ring's p2p, checked
against comm_stats' "cp/ring_p2p"), all_gather ((p-1) copies of the input: position ids, once
per step for ours, per layer for ALST); "total" is their sum. The loss's two-scalar all-reduces
are the same for every stack and not counted. Time per step: median of --reps interleaved
repetitions after one warm-up, max over ranks (and the fastest repetition, "min": on a shared
machine the repetitions are bimodal with other tenants' load); os.getloadavg() after each
world's spawn. The
stacks' losses are reported side by side (same model, same batch: equal to fp32 summation order).
Writes bench/results/hf_ulysses_cpu.json.

    python bench/hf_ulysses.py                       # worlds 2 4, s 2048, 5 reps
    python bench/hf_ulysses.py --world 2 --seq 1024 --reps 3

Times on a shared CPU with fewer cores than ranks (4 ranks on 2 cores: oversubscribed) include
the oversubscription: they compare the stacks on this machine, not on GPUs. `gpu_qwen3_4b_row()`
is the Qwen3-4B row (the HF ALST blog's case, sp 4 at 96K): it runs only where CUDA is present
(python bench/hf_ulysses.py --gpu) and was not run here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_sp.testing import run_distributed  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                            "hf_ulysses_cpu.json")
KIB = 1024
TORCH_CP_NOT_RUN = ("not run: accelerate's cp_size needs FSDP2 on a GPU; torch 2.13's "
                    "context_parallel on CPU gloo fails (no sharding strategy for "
                    "aten._scaled_dot_product_flash_attention_for_cpu)")


def tiny_config(family: str, layers: int = 2):
    from transformers import LlamaConfig, Qwen3Config
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    return cls(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
               num_attention_heads=8, num_key_value_heads=4, head_dim=16,
               max_position_embeddings=1 << 17, tie_word_embeddings=False)


def build(config, seed: int = 0):
    """A model of its OWN copy of `config`: from_config keeps the config object it is given, and
    both megatron_sp.hf.sequence_parallel and from_config(attn_implementation=) set its
    _attn_implementation, so models sharing one config would all run whichever was set last
    (the earlier version of this bench timed ALST against ALST that way)."""
    import copy

    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                            dtype=torch.float32)


def layouts(world: int) -> list[tuple[str, int, int]]:
    """Our stacks on `world` ranks: (name, sp, cp) with sp cp = world: Ulysses alone, the ring
    alone, and every hybrid sp a x cp r with 1 < a, r."""
    out = [(f"ours sp{world}", world, 1), (f"ours cp{world}", 1, world)]
    out += [(f"ours sp{a}xcp{world // a}", a, world // a)
            for a in range(2, world) if world % a == 0]
    return out


def p2p_send_bytes(ops) -> int:
    """Bytes a rank sends in one batch_isend_irecv: the tensors of its isend ops."""
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops
               if getattr(op.op, "__name__", "") == "isend")


class _Counter:
    """Bytes sent per collective kind, counted by wrapping torch.distributed functions (this
    process only, for the benchmark): all-to-all sends (p-1)/p of its input, all-gather (p-1)
    copies of its input, batch_isend_irecv its isend tensors."""

    KINDS = ("all_to_all", "p2p", "all_gather")

    def __init__(self):
        import torch.distributed as dist
        self.dist, self.bytes = dist, dict.fromkeys(self.KINDS, 0)
        a2a, ag, batch = dist.all_to_all_single, dist.all_gather, dist.batch_isend_irecv

        def all_to_all_single(output, input, *args, group=None, **kwargs):
            p = dist.get_world_size(group)
            self.bytes["all_to_all"] += input.numel() * input.element_size() * (p - 1) // p
            return a2a(output, input, *args, group=group, **kwargs)

        def all_gather(tensor_list, tensor, *args, **kwargs):
            self.bytes["all_gather"] += tensor.numel() * tensor.element_size() * (len(tensor_list) - 1)
            return ag(tensor_list, tensor, *args, **kwargs)

        def batch_isend_irecv(ops):
            self.bytes["p2p"] += p2p_send_bytes(ops)
            return batch(ops)

        dist.all_to_all_single, dist.all_gather = all_to_all_single, all_gather
        dist.batch_isend_irecv = batch_isend_irecv

    def reset(self):
        self.bytes = dict.fromkeys(self.bytes, 0)


def _deepspeed():
    try:
        import deepspeed  # noqa: F401
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        return UlyssesSPAttentionHF, None
    except Exception as err:  # ImportError, or a build that fails at import on this machine
        return None, f"not installed ({type(err).__name__})"


def _run(rank, world, families, seq, reps):
    import torch.distributed as dist

    from megatron_sp import comm_stats, hf
    from megatron_sp.mesh import ParallelMesh

    counter = _Counter()
    ds_cls, ds_missing = _deepspeed()
    if ds_cls is not None:
        import deepspeed
        deepspeed.init_distributed("gloo")          # reuses the process group started here
    world_group = dist.new_group(list(range(world)))
    meshes = {name: ParallelMesh.from_sizes(sp=a, cp=r) for name, a, r in layouts(world)}
    rows = []
    for family in families:
        config = tiny_config(family)
        gen = torch.Generator().manual_seed(11)
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=gen)
        batch = {"input_ids": ids, "labels": ids}
        stacks = {}                                  # name: (model, shard, sp_group, cp_group)
        # ours first: DeepSpeed's registration replaces transformers' "sdpa" entry for the
        # whole process (ours keeps the function it wrapped)
        for name, mesh in meshes.items():
            sp_group = mesh.sp_group if mesh.sp_size > 1 else None
            cp_group = mesh.cp_group if mesh.cp_size > 1 else None
            model = hf.sequence_parallel(build(config), sp_group, cp_group)
            stacks[name] = (model, hf.shard_batch(batch, sp_group, cp_group), sp_group, cp_group)
        if ds_cls is not None:
            ds_model = build(config)
            ds_cls.register_with_transformers(model_name_or_path=ds_model,
                                              core_attn_implementation="sdpa",
                                              sequence_parallel_size=world, micro_batch_size=1,
                                              seq_length_is_variable=True)
            stacks[f"ALST sp{world}"] = (ds_model, hf.shard_batch(batch, world_group),
                                         world_group, None)

        def step(name):
            model, shard, sp_group, cp_group = stacks[name]
            model.zero_grad(set_to_none=True)
            out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                        use_cache=False)
            loss = hf.loss(out.logits, shard, sp_group, cp_group)
            loss.backward()
            return loss.item()

        sent, losses, ring_stats = {}, {}, {}
        for name, (model, *_) in stacks.items():
            expected = "sdpa" if name.startswith("ALST") else "megatron_sp_ulysses_sdpa"
            assert model.config._attn_implementation == expected, (name, expected)
        for name in stacks:
            counter.reset()
            comm_stats.reset()
            losses[name] = step(name)
            sent[name] = dict(counter.bytes)
            ring_stats[name] = comm_stats.snapshot().get("cp/ring_p2p", 0)
            assert ring_stats[name] == sent[name]["p2p"], (name, ring_stats[name], sent[name])
        times = {name: [] for name in stacks}
        names = list(stacks)
        for rep in range(reps + 1):                  # repetition 0 warms up
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                dist.barrier()
                start = time.perf_counter()
                step(name)
                elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep:
                    times[name].append(elapsed.item())
        layers = config.num_hidden_layers
        stats = {}
        for name in stacks:
            per_layer = {k: v / layers for k, v in sent[name].items()}
            stats[name] = {"loss": losses[name], "median_s": statistics.median(times[name]),
                           "times_s": times[name],
                           "a2a_bytes_per_layer": per_layer["all_to_all"],
                           "p2p_bytes_per_layer": per_layer["p2p"],
                           "gather_bytes_per_layer": per_layer["all_gather"],
                           "total_bytes_per_layer": sum(per_layer.values())}
        rows.append({"family": family, "world": world, "seq": seq, "layers": layers,
                     "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                     "head_dim": config.head_dim, "hidden": config.hidden_size,
                     "deepspeed": ds_missing or "installed", "stacks": stats})
    return rows


def table_rows(rank_rows: list[dict], command: str, load: str) -> list[dict]:
    """One flat row per (family, world, stack) from rank 0's results (times: max over ranks
    already), with the ALST stack of the same world as the comparison: ours/ALST time ratio,
    ALST's bytes per layer, |loss - ALST loss|; torch CP rows say why they were not run."""
    out = []
    for r in rank_rows:
        alst = r["stacks"].get(f"ALST sp{r['world']}")
        for name, st in r["stacks"].items():
            is_alst = name.startswith("ALST")
            row = {"family": r["family"], "layout": name.replace("ours ", ""),
                   "stack": "ALST" if is_alst else "ours", "ranks": r["world"], "seq": r["seq"],
                   "ms": 1e3 * st["median_s"],
                   "alst_ms": 1e3 * alst["median_s"] if alst else None,
                   "ratio_vs_alst": st["median_s"] / alst["median_s"] if alst and not is_alst else None,
                   "min_ms": 1e3 * min(st["times_s"]),
                   "min_ratio_vs_alst": (min(st["times_s"]) / min(alst["times_s"])
                                         if alst and not is_alst else None),
                   "a2a_kib_layer": st["a2a_bytes_per_layer"] / KIB,
                   "p2p_kib_layer": st["p2p_bytes_per_layer"] / KIB,
                   "gather_kib_layer": st["gather_bytes_per_layer"] / KIB,
                   "total_kib_layer": st["total_bytes_per_layer"] / KIB,
                   "alst_total_kib_layer": alst["total_bytes_per_layer"] / KIB if alst else None,
                   "loss": st["loss"], "alst_loss": alst["loss"] if alst else None,
                   "loss_abs_diff": abs(st["loss"] - alst["loss"]) if alst else None,
                   "times_s": st["times_s"], "load_avg": load, "command": command}
            out.append(row)
        out.append({"family": r["family"], "layout": f"torch CP cp{r['world']}", "stack": "torch",
                    "ranks": r["world"], "seq": r["seq"], "status": TORCH_CP_NOT_RUN,
                    "load_avg": load, "command": command})
    return out


def _cell(v, fmt):
    return f"{'-':>{int(fmt.split('.')[0])}}" if v is None else format(v, fmt)


def print_table(rows: list[dict]) -> None:
    header = (f"{'model':>6} {'layout':>12} {'ranks':>5} {'s':>5} | {'ms':>7} {'ALST ms':>7} "
              f"{'/ALST':>5} {'min':>6} {'/ALST':>5} | {'a2a':>7} {'p2p':>7} {'gather':>6} {'total':>7} "
              f"{'ALST':>7} KiB/layer | {'loss':>9} {'|d ALST|':>8} | load")
    print(f"\n{header}\n{'-' * len(header)}")
    for r in rows:
        lead = f"{r['family']:>6} {r['layout']:>12} {r['ranks']:>5} {r['seq']:>5} | "
        if "status" in r:
            print(f"{lead}{r['status']}")
            continue
        print(f"{lead}{r['ms']:>7.1f} {_cell(r['alst_ms'], '7.1f')} "
              f"{_cell(r['ratio_vs_alst'], '5.2f')} {r['min_ms']:>6.1f} "
              f"{_cell(r['min_ratio_vs_alst'], '5.2f')} | {r['a2a_kib_layer']:>7.1f} "
              f"{r['p2p_kib_layer']:>7.1f} {r['gather_kib_layer']:>6.1f} "
              f"{r['total_kib_layer']:>7.1f} {_cell(r['alst_total_kib_layer'], '7.1f')}"
              f"{'':>10} | {r['loss']:>9.6f} {_cell(r['loss_abs_diff'], '8.1e')} | "
              f"{r['load_avg']}")


def gpu_qwen3_4b_row(seq: int = 96 * 1024, sp: int = 4, layers: int | None = None) -> dict:
    """The Qwen3-4B row where CUDA is present: one GPU runs one sp rank's share of an sp-way job
    (s/sp tokens with global positions; the all-to-alls need the other ranks, so communication is
    NOT included), bf16, with megatron_sp.hf.memory's tiled MLP and host-offloaded layer
    checkpoints and the tiled loss: time per step and peak memory. Not run on the CPU machine."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from transformers import AutoModelForCausalLM, Qwen3Config

    from megatron_sp import hf
    from megatron_sp.hf.memory import offload_checkpointing, tile_mlp
    config = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                         num_hidden_layers=layers or 36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 17,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                             dtype=torch.bfloat16).cuda()
    offload_checkpointing(tile_mlp(model))
    local = seq // sp
    ids = torch.randint(0, config.vocab_size, (1, local), device="cuda")
    shard = {"input_ids": ids, "shift_labels": ids.roll(-1, 1),
             "position_ids": torch.arange(local, device="cuda")[None] + local}   # rank 1's chunk
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        hidden = model.model(input_ids=ids, position_ids=shard["position_ids"]).last_hidden_state
        hf.tiled_loss(hidden, model.lm_head.weight, shard, None).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {"model": "Qwen3-4B shape", "seq": seq, "sp": sp, "tokens_per_rank": local,
            "median_s": statistics.median(times[1:]), "peak_bytes": torch.cuda.max_memory_allocated(),
            "device": torch.cuda.get_device_name(), "communication": "not included (one device)"}


def memory_rows(seq: int = 4096, family: str = "qwen3", tiles: int = 4) -> list[dict]:
    """One process, no sp: bytes kept for backward by one training step of a 4-layer tiny model
    (megatron_sp.hf.memory.saved_bytes: saved-tensor hooks, activations only), plain against the
    tiled MLP, the host-offloaded layer checkpoints and both; each row's loss is reported."""
    import torch.nn.functional as F

    from megatron_sp.hf.memory import offload_checkpointing, saved_bytes, tile_mlp
    config = tiny_config(family, layers=4)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(5))
    setups = {"plain": lambda m: m, f"tiled mlp ({tiles})": lambda m: tile_mlp(m, tiles),
              "offload ckpt": offload_checkpointing,
              "both": lambda m: offload_checkpointing(tile_mlp(m, tiles))}
    rows = []
    for name, apply in setups.items():
        model = apply(build(config))

        def step():
            logits = model(input_ids=ids, use_cache=False).logits            # [1, s, V]
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            return loss.item()

        loss = step()
        model.zero_grad(set_to_none=True)
        rows.append({"setup": name, "family": family, "seq": seq, "layers": 4, "loss": loss,
                     **saved_bytes(step)})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", "--sp", type=int, nargs="+", default=[2, 4],
                   help="world sizes (ranks); each runs ALST sp W, ours sp W, cp W, sp x cp")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--families", nargs="+", default=["qwen3", "llama"])
    p.add_argument("--json", default=DEFAULT_JSON)
    p.add_argument("--gpu", action="store_true", help="also the Qwen3-4B row (needs CUDA)")
    p.add_argument("--memory-seq", type=int, default=4096, help="memory table's s (0: none)")
    args = p.parse_args()
    command = " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv])
    machine = f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"command: {command}\ntorch {torch.__version__}, gloo, fp32 on CPU; {machine}; "
          f"load average at start {load}")
    print(f"One training step (forward, megatron_sp.hf.loss, backward), b=1, s={args.seq}; "
          f"KiB sent per rank and decoder layer, forward + backward; time: median of {args.reps} "
          f"interleaved repetitions, max over ranks (min: the fastest repetition, less sensitive to "
          f"other load on a shared machine); /ALST: time over ALST's at the same ranks. "
          f"Ranks > {os.cpu_count()} cores are oversubscribed.")
    rows = []
    for world in args.world:
        # One spawn per model: DeepSpeed's registration replaces transformers' "sdpa" entry for
        # the whole process, with the head counts of the model it was given.
        per_family = [run_distributed(_run, world, [family], args.seq, args.reps,
                                      timeout_s=3600.0, collective_timeout_s=600.0)
                      for family in args.families]
        spawn_load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        per_rank = [sum((ranks[r] for ranks in per_family), []) for r in range(world)]
        for rank_rows in per_rank[1:]:
            for mine, first in zip(rank_rows, per_rank[0]):
                for name, st in first["stacks"].items():
                    assert mine["stacks"][name]["total_bytes_per_layer"] == st["total_bytes_per_layer"]
        world_rows = table_rows(per_rank[0], command, spawn_load)
        print_table(world_rows)
        rows += world_rows
    print(f"\nBytes kept for backward, one process, {args.families[0]} 4 layers, s={args.memory_seq} "
          f"(saved-tensor hooks; on CPU 'host' is the offload copy)")
    memory = memory_rows(args.memory_seq, args.families[0]) if args.memory_seq else []
    for row in memory:
        print(f"  {row['setup']:>15}: device {row['device_bytes'] / 2**20:8.2f} MiB, host "
              f"{row['host_bytes'] / 2**20:8.2f} MiB, loss {row['loss']:.6f} "
              f"({row['device_bytes'] / memory[0]['device_bytes']:.2f}x plain device bytes)")
    gpu = gpu_qwen3_4b_row() if args.gpu else {"skipped": "not requested (--gpu)"}
    print(f"\nQwen3-4B GPU row: {gpu}")
    end_load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"command": command, "torch": torch.__version__, "machine": machine,
                       "load_average_at_start": load, "load_average_at_end": end_load,
                       "seq": args.seq, "reps": args.reps, "rows": rows, "memory": memory,
                       "gpu_qwen3_4b": gpu}, f, indent=1)
        os.replace(tmp, args.json)
        print(f"rows written to {args.json}")


if __name__ == "__main__":
    main()
