#!/usr/bin/env python
"""Hugging Face models under Ulysses: megatron_sp.hf against DeepSpeed's UlyssesSPAttentionHF (ALST).

On sp gloo ranks (spawned on this CPU), a tiny random Qwen3 and Llama (built from configs, same
weights for both stacks), one sequence of --seq tokens cut into sp contiguous chunks with global
position ids, and one training step (forward, the exact loss megatron_sp.hf.loss, backward):

  ours      megatron_sp.hf.sequence_parallel(model, group): our packed q/k/v seq->head all-to-all
            and the head->seq one around transformers' sdpa
  deepspeed UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, ...): DeepSpeed's
            wrapper in transformers' attention registry (its own all-to-alls and a per-layer
            all-gather of the position ids); "not installed" when deepspeed does not import

Per rank: the bytes this rank sends in all-to-alls per decoder layer (forward + backward of one
step; counted by wrapping torch.distributed.all_to_all_single for both stacks alike, so both count
(sp-1)/sp of every buffer, the figure of megatron_sp/comm_stats.py), other collective bytes per
layer (all-gathers), and the time per step: median of --reps interleaved repetitions after one
warm-up, max over ranks. The two stacks' losses are reported side by side (loss_abs_diff; same model, same batch).
Writes bench/results/hf_ulysses_cpu.json.

    python bench/hf_ulysses.py                       # sp 2 4, s 2048, 5 reps
    python bench/hf_ulysses.py --sp 2 --seq 1024 --reps 3

Times on a shared CPU with fewer cores than ranks include the oversubscription: they compare the
two stacks on this machine, not on GPUs. `gpu_qwen3_4b_row()` is the Qwen3-4B row (the HF ALST blog's
case, sp 4 at 96K): it runs only where CUDA is present (python bench/hf_ulysses.py --gpu) and was
not run here.
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


def tiny_config(family: str, layers: int = 2):
    from transformers import LlamaConfig, Qwen3Config
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    return cls(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
               num_attention_heads=8, num_key_value_heads=4, head_dim=16,
               max_position_embeddings=1 << 17, tie_word_embeddings=False)


def build(config, seed: int = 0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


class _Counter:
    """Bytes sent per collective kind, counted by wrapping torch.distributed functions (this
    process only, for the benchmark): all-to-all sends (p-1)/p of its input, all-gather (p-1)
    copies of its input."""

    def __init__(self):
        import torch.distributed as dist
        self.dist, self.bytes = dist, {"all_to_all": 0, "all_gather": 0}
        self._a2a, self._ag = dist.all_to_all_single, dist.all_gather

        def all_to_all_single(output, input, *args, group=None, **kwargs):
            p = dist.get_world_size(group)
            self.bytes["all_to_all"] += input.numel() * input.element_size() * (p - 1) // p
            return self._a2a(output, input, *args, group=group, **kwargs)

        def all_gather(tensor_list, tensor, *args, **kwargs):
            self.bytes["all_gather"] += tensor.numel() * tensor.element_size() * (len(tensor_list) - 1)
            return self._ag(tensor_list, tensor, *args, **kwargs)

        dist.all_to_all_single, dist.all_gather = all_to_all_single, all_gather

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

    from megatron_sp import hf

    counter = _Counter()
    group = dist.new_group(list(range(world)))
    ds_cls, ds_missing = _deepspeed()
    if ds_cls is not None:
        import deepspeed
        deepspeed.init_distributed("gloo")          # reuses the process group started here
    rows = []
    for family in families:
        config = tiny_config(family)
        gen = torch.Generator().manual_seed(11)
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=gen)
        shard = hf.shard_batch({"input_ids": ids, "labels": ids}, group)
        models = {"ours": hf.sequence_parallel(build(config), group)}
        if ds_cls is not None:
            ds_model = build(config)
            ds_cls.register_with_transformers(model_name_or_path=ds_model,
                                              core_attn_implementation="sdpa",
                                              sequence_parallel_size=world, micro_batch_size=1,
                                              seq_length_is_variable=True)
            models["deepspeed"] = ds_model

        def step(name):
            model = models[name]
            model.zero_grad(set_to_none=True)
            out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                        use_cache=False)
            loss = hf.loss(out.logits, shard, group)
            loss.backward()
            return loss.item()

        sent, losses = {}, {}
        for name in models:
            counter.reset()
            losses[name] = step(name)
            sent[name] = dict(counter.bytes)
        times = {name: [] for name in models}
        names = list(models)
        for rep in range(reps + 1):                  # repetition 0 warms up
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                dist.barrier()
                start = time.perf_counter()
                step(name)
                elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep:
                    times[name].append(elapsed.item())
        row = {"family": family, "sp": world, "seq": seq, "layers": config.num_hidden_layers,
               "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
               "head_dim": config.head_dim, "hidden": config.hidden_size,
               "deepspeed": ds_missing or "installed"}
        for name in models:
            row[name] = {"loss": losses[name], "median_s": statistics.median(times[name]),
                         "times_s": times[name],
                         "a2a_bytes_per_layer": sent[name]["all_to_all"] / config.num_hidden_layers,
                         "other_bytes_per_layer": sent[name]["all_gather"] / config.num_hidden_layers}
        rows.append(row)
    return rows


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
    p.add_argument("--sp", type=int, nargs="+", default=[2, 4])
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
          f"bytes per rank and decoder layer, forward + backward; time: median of {args.reps} "
          f"interleaved repetitions, max over ranks.")
    header = (f"{'model':>6} {'sp':>2} | {'ours a2a KiB/layer':>18} {'ds a2a KiB/layer':>16} "
              f"{'ds gather KiB/layer':>19} {'ratio':>6} | {'ours ms':>8} {'ds ms':>8} "
              f"{'ds/ours':>7} | {'|loss diff|':>11}")
    print(f"\n{header}\n{'-' * len(header)}")
    rows = []
    for sp in args.sp:
        # One spawn per model: DeepSpeed's registration replaces transformers' "sdpa" entry for
        # the whole process, with the head counts of the model it was given.
        per_family = [run_distributed(_run, sp, [family], args.seq, args.reps,
                                      timeout_s=3600.0, collective_timeout_s=600.0)
                      for family in args.families]
        per_rank = [sum((ranks[r] for ranks in per_family), []) for r in range(sp)]
        for rank_rows in per_rank[1:]:
            for mine, first in zip(rank_rows, per_rank[0]):
                for name in ("ours", "deepspeed"):
                    if name in first:
                        assert mine[name]["a2a_bytes_per_layer"] == first[name]["a2a_bytes_per_layer"]
        for row in per_rank[0]:
            ours, ds = row["ours"], row.get("deepspeed")
            if isinstance(ds, dict):
                ratio = ds["a2a_bytes_per_layer"] / ours["a2a_bytes_per_layer"]
                row["bytes_ratio_ds_over_ours"] = ratio
                row["time_ratio_ds_over_ours"] = ds["median_s"] / ours["median_s"]
                row["loss_abs_diff"] = abs(ds["loss"] - ours["loss"])
                ds_cols = (f"{ds['a2a_bytes_per_layer'] / KIB:>16.1f} "
                           f"{ds['other_bytes_per_layer'] / KIB:>19.2f} {ratio:>6.2f} | "
                           f"{1e3 * ours['median_s']:>8.1f} {1e3 * ds['median_s']:>8.1f} "
                           f"{row['time_ratio_ds_over_ours']:>7.2f} | {row['loss_abs_diff']:>11.2e}")
            else:
                ds_cols = (f"{row['deepspeed']:>43} | {1e3 * ours['median_s']:>8.1f} "
                           f"{'-':>8} {'-':>7} | {'-':>11}")
            print(f"{row['family']:>6} {row['sp']:>2} | {ours['a2a_bytes_per_layer'] / KIB:>18.1f} "
                  f"{ds_cols}")
            rows.append(row)
    print(f"\nBytes kept for backward, one process, {args.families[0]} 4 layers, s={args.memory_seq} "
          f"(saved-tensor hooks; on CPU 'host' is the offload copy)")
    memory = memory_rows(args.memory_seq, args.families[0]) if args.memory_seq else []
    for row in memory:
        print(f"  {row['setup']:>15}: device {row['device_bytes'] / 2**20:8.2f} MiB, host "
              f"{row['host_bytes'] / 2**20:8.2f} MiB, loss {row['loss']:.6f} "
              f"({row['device_bytes'] / memory[0]['device_bytes']:.2f}x plain device bytes)")
    gpu = gpu_qwen3_4b_row() if args.gpu else {"skipped": "not requested (--gpu)"}
    print(f"\nQwen3-4B GPU row: {gpu}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"command": command, "torch": torch.__version__, "machine": machine,
                       "load_average_at_start": load, "seq": args.seq, "reps": args.reps,
                       "rows": rows, "memory": memory, "gpu_qwen3_4b": gpu}, f, indent=1)
        os.replace(tmp, args.json)
        print(f"rows written to {args.json}")


if __name__ == "__main__":
    main()
