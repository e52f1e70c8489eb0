#!/usr/bin/env python
"""One GPU: training tokens/s and MFU of llama-1b and a Llama-3-8B-shaped model with fewer layers, at
8K and 32K: eager vs compiled (--torch-compile's per-layer torch.compile), SDPA vs FlexAttention
(with and without packed documents), ours vs Hugging Face transformers' LlamaForCausalLM on the same
weights and batch (both bf16 autocast over fp32 weights, both SDPA, both compiled or both not).

    python bench/gpu_throughput.py                        # the row list below, time-boxed
    python bench/gpu_throughput.py --models llama-1b --seqs 8192 --budget-s 200
    python bench/gpu_throughput.py --dry-run              # CPU: the row list and JSON on a tiny model

One step = forward + loss + backward + fused AdamW, batch 1; tokens/s = seq / the median of
--timed-steps steps after --warmup-steps (the first compiles). MFU = Megatron's model FLOPs per step
(megatron_sp.training.flops) / step time / the bf16 dense peak: H200 (and H100) SXM 989 TFLOP/s
(megatron_sp.training.flops.PEAK_TFLOPS; --peak-tflops overrides). Peak memory is
torch.cuda.max_memory_allocated of the row. The 8B-shaped model keeps Llama-3-8B's widths (hidden
4096, 32 heads, 8 kv heads, ffn 14336, vocab 128256) with, at each sequence length, as many layers as
the memory planner (megatron_sp.memory.planner, bench/gpu_long_context.py's model of this step) fits
on this device (on an H200's 139 GiB: 19 at 8K, 8 at 32K; --layers-8b overrides). Hugging Face rows run without documents (its SDPA path
takes no packed-document mask without materialising it). FlexAttention is
`--attention-backend flex`: a row whose backend raises records "not available: <why>".

Rows go to bench/results/gpu_throughput_<device>.json (docs/performance.md's schema) after every row,
so a run cut short keeps what it measured; rows the time box did not reach say "no time".
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from megatron_sp.compile import compile_layers, reset as reset_compiled  # noqa: E402
from megatron_sp.mesh import ParallelMesh  # noqa: E402
from megatron_sp.models import GPTModel, preset  # noqa: E402
from megatron_sp.training.flops import device_peak_tflops, flops_for_config  # noqa: E402

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            kv_channels=16, ffn_hidden_size=128, vocab_size=256)
COLUMNS = [("model", "model"), ("layers", "layers"), ("seq", "seq"), ("impl", "impl"),
           ("attention", "attention"), ("documents", "documents"), ("compiled", "compiled"),
           ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("vs_hf", "ours/HF"),
           ("peak_memory_gib", "peak GiB"), ("status", "status")]


def plan_rows(models, seqs) -> list[dict]:
    """The row specs, most wanted first (the 8B-shaped rows at 8K are the goal: MFU >= 45%)."""
    rows = []
    for seq in seqs:
        for model in models:
            for compiled in (False, True):
                rows.append(dict(model=model, seq=seq, impl="hf", attention="sdpa",
                                 documents=False, compiled=compiled))
                for attention, documents in (("sdpa", False), ("flex", False), ("flex", True)):
                    rows.append(dict(model=model, seq=seq, impl="ours", attention=attention,
                                     documents=documents, compiled=compiled))
    order = {m: i for i, m in enumerate(models)}
    return sorted(rows, key=lambda r: (r["seq"], -order[r["model"]], r["compiled"]))


def model_config(name: str, seq: int, layers_8b: int | None, dry_run: bool):
    if dry_run:      # the preset's other fields (tied embeddings, RoPE base) at tiny widths
        return preset("llama-8b" if name == "llama-8b-shaped" else name, **TINY,
                      max_position_embeddings=seq)
    if name == "llama-8b-shaped":
        return preset("llama-8b", num_layers=layers_8b, max_position_embeddings=seq)
    return preset(name, max_position_embeddings=seq)


def layers_that_fit(seq: int, device_gib: float) -> int:
    """The most Llama-3-8B-shaped layers whose planned step (bench/gpu_long_context.py: fp32 weights,
    grads, AdamW, bf16 copies, activations; + 10% fragmentation + 4 GiB reserve) fits at `seq`."""
    from gpu_long_context import predicted_gb
    fits = lambda n: predicted_gb(preset("llama-8b", num_layers=n, max_position_embeddings=seq),  # noqa: E731
                                  {}, seq) * 1.10 + 4.0 <= device_gib
    n = 1
    while n < 32 and fits(n + 1):
        n += 1
    return n


def document_ids(seq: int, device, seed: int = 0) -> torch.Tensor:
    """[1, seq] int64: documents of random lengths (mean seq/8), every one at least 1 token."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.rand(seq, generator=gen) < 8.0 / seq
    starts[0] = True
    return (torch.cumsum(starts.long(), 0) - 1)[None].to(device)


def build(spec, cfg, device, backend):
    """(model, optimizer, step function) of one row; HF gets our initial weights."""
    from megatron_sp.models.init import init_parameters
    ours = GPTModel(cfg, attention_backend=spec["attention"] if spec["impl"] == "ours" else "sdpa")
    init_parameters(ours, seed=0)
    model = ours
    if spec["impl"] == "hf":
        import warnings
        from train_step import copy_into_hf, hf_model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = hf_model("llama", cfg, "sdpa")
        copy_into_hf(ours, model, "llama", cfg)
        del ours
    model = model.to(device).train()
    if spec["compiled"]:
        if spec["impl"] == "ours":
            compile_layers([model], ParallelMesh.single(), backend=backend)
        else:                                      # the same per-layer compile for HF
            for layer in model.model.layers:
                layer.compile(backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    return model, opt


def step_fn(spec, model, opt, cfg, seq, device):
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=device)
    docs = document_ids(seq, device) if spec["documents"] else None

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if spec["impl"] == "hf":
                loss = model(input_ids=ids, labels=ids).loss
            else:
                loss = model(input_ids=ids, labels=ids.roll(-1, 1), document_ids=docs).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(spec, args, device, peak):
    """One row: the spec with tokens_per_s, mfu, peak_memory_gib and status filled in."""
    cfg = model_config(spec["model"], spec["seq"], args.layers_per_seq[spec["seq"]], args.dry_run)
    seq = spec["seq"]
    row = dict(spec, layers=cfg.num_layers, tokens_per_s=None, mfu=None, peak_memory_gib=None)
    model = opt = None
    try:
        reset_compiled()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model, opt = build(spec, cfg, device, args.compile_backend)
        step = step_fn(spec, model, opt, cfg, seq, device)
        for _ in range(args.warmup_steps):
            step()
        times = []
        for _ in range(args.timed_steps):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t0)
        dt = statistics.median(times)
        row.update(tokens_per_s=seq / dt, status="ok",
                   mfu=flops_for_config(cfg, 1, seq) / dt / 1e12 / peak if peak else None)
        if device.type == "cuda":
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.cuda.OutOfMemoryError:
        row["status"] = "OOM"
    except Exception as err:      # a backend that is not there (flex), or its missing backward
        name = type(err).__name__
        where = "attention" if spec["attention"] == "flex" else spec["impl"]
        row["status"] = f"not available ({where}): {name}: {str(err).splitlines()[0][:120]}" \
            if spec["attention"] == "flex" else f"error: {name}: {str(err).splitlines()[0][:120]}"
        if args.verbose:
            traceback.print_exc()
    finally:
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def add_ratios(rows):
    """ours/HF tokens/s beside each of our rows, against the HF row of the same model, seq and
    compile setting."""
    hf = {(r["model"], r["seq"], r["compiled"]): r for r in rows if r["impl"] == "hf"}
    for r in rows:
        other = hf.get((r["model"], r["seq"], r["compiled"]))
        r["vs_hf"] = (r["tokens_per_s"] / other["tokens_per_s"]
                      if r["impl"] == "ours" and r.get("tokens_per_s") and other
                      and other.get("tokens_per_s") else None)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["llama-1b", "llama-8b-shaped"],
                   choices=["llama-1b", "llama-8b-shaped"])
    p.add_argument("--seqs", nargs="+", type=int, default=[8192, 32768])
    p.add_argument("--layers-8b", type=int, default=None,
                   help="layers of the 8B-shaped model (default: as many as the planner fits)")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--timed-steps", type=int, default=3)
    p.add_argument("--compile-backend", default=None, help="inductor (aot_eager with --dry-run)")
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole run")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--results", default="gpu_throughput_{device}",
                   help="bench/results/NAME.json; '' writes nothing")
    p.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: every row on a 2-layer 64-wide model at --seqs 64, 0 warm-up + 1 "
                        "timed step (compile backend: --compile-backend, aot_eager unless given): "
                        "checks the row list and the JSON")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        args.seqs, args.warmup_steps, args.timed_steps = [64], 0, 1
        args.compile_backend, args.layers_8b = args.compile_backend or "aot_eager", args.layers_8b or 2
    args.compile_backend = args.compile_backend or "inductor"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("bench/gpu_throughput.py needs a CUDA GPU (or --dry-run on CPU).")
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    peak = device_peak_tflops(args.peak_tflops) if cuda else None
    fit = {}                                   # seq -> 8B-shaped layers (as many as fit there)
    if cuda:
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        fit = {seq: args.layers_8b or layers_that_fit(seq, gib) for seq in args.seqs}
    args.layers_per_seq = fit or {seq: args.layers_8b for seq in args.seqs}
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    from performance_table import device_info, write_results
    info = device_info(peak, "bf16 dense, megatron_sp.training.flops.PEAK_TFLOPS" if peak else
                       "dry run on CPU: no peak, no MFU")
    specs = plan_rows(args.models, args.seqs)
    print(f"{info['name']}; {len(specs)} rows; 8B-shaped layers per seq: {args.layers_per_seq}; peak "
          f"{peak or '-'} TFLOP/s; compile backend {args.compile_backend}", flush=True)
    start, rows = time.time(), []
    for spec in specs:
        if time.time() - start > args.budget_s:
            rows.append(dict(spec, layers=None, tokens_per_s=None, mfu=None,
                             peak_memory_gib=None, status="no time"))
        else:
            rows.append(measure(spec, args, device, peak))
        r = rows[-1]
        print(f"  {r['model']:>15} {r['seq']:>6} {r['impl']:>4} {r['attention']:>4} "
              f"docs={r['documents']!s:<5} compiled={r['compiled']!s:<5} "
              + (f"{r['tokens_per_s']:9.0f} tok/s" if r["tokens_per_s"] else " " * 15)
              + (f" MFU {100 * r['mfu']:5.1f}%" if r["mfu"] else "") + f"  {r['status']}",
              flush=True)
        if args.results:
            name = args.results.format(device="dry_run_cpu" if args.dry_run else "h200"
                                       if "H200" in info["name"] else info["kind"])
            path = write_results(
                name, "gpu_throughput", add_ratios([dict(x) for x in rows]), columns=COLUMNS,
                title="training throughput: eager vs compiled, SDPA vs flex, ours vs HF",
                device=info, folder=args.results_dir,
                notes=[f"batch 1, bf16 autocast over fp32 weights, fused AdamW; median of "
                       f"{args.timed_steps} steps after {args.warmup_steps} warm-up; compile "
                       f"backend {args.compile_backend}, one graph per transformer layer (both)",
                       f"llama-8b-shaped: Llama-3-8B widths, layers per seq "
                       f"{args.layers_per_seq} (as many as the planner fits)"])
    if args.results:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
