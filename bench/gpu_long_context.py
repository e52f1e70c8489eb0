#!/usr/bin/env python
"""One GPU: the longest sequence that trains for a ~1B Llama-style model (preset llama-1b, bf16
autocast over fp32 master weights, SDPA flash kernel) with each memory technique, and MFU at 8K and 32K.

    python bench/gpu_long_context.py                 # whole run time-boxed to --budget-s (default 450)
    python bench/gpu_long_context.py --techniques plain all --max-seq 262144

Each technique runs in a process of its own (an out-of-memory error can leave tensors behind that
would shrink the next technique's room): the sequence doubles from --start-seq while a
forward+backward+AdamW step fits and the technique's time box is not spent. MFU uses
megatron_sp.training.flops (Megatron's formula) against the device's bf16 dense peak (megatron_sp.training.flops
.PEAK_TFLOPS; --peak-tflops overrides). Beside each measured peak (torch.cuda.max_memory_allocated)
the planner's modelled bytes for the same run (megatron_sp.memory.planner: 16 bytes/param of fp32
weights, grads and AdamW state, 2 of bf16 weight copies + the step's activation peak under bf16 autocast; no reserve), and per
technique the longest sequence the planner predicts for this device (modelled bytes + 10%
fragmentation + 4 GB reserve within its memory). The activation peak is also checked on its own:
the first step's peak up to the end of backward, less the weights present before it and autocast's
bf16 copies (2 bytes per parameter; gradients accumulated by the peak are left in, a few GB at most
early in backward), against the planner's step_peak_bytes (device="cuda": torch's fused RMSNorm).
Prints one table; --json writes the rows; every run also writes bench/results/gpu_long_context_<gpu>.json
(docs/performance.md's schema: longest sequence per technique beside the planner's, MFU at 8K/32K).

    python bench/gpu_long_context.py --techniques all --attention flex --documents --start-seq 32768
        # the longest llama-1b sequence with packed documents through FlexAttention (no s x s mask)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_sp.training.flops import device_peak_tflops, flops_for_config  # noqa: E402
from megatron_sp.memory import TECHNIQUES as ALL_TECHNIQUES  # noqa: E402
from megatron_sp.memory import MemoryOptions, SavedTensorAccountant  # noqa: E402
from megatron_sp.memory.planner import model_state_bytes, step_peak_bytes  # noqa: E402
from megatron_sp.models import GPTModel, preset  # noqa: E402

TECHNIQUES = {name: ALL_TECHNIQUES[name] for name in (
    "plain", "chunked loss", "tiled mlp", "selective", "full recompute", "all", "all+offload")}


def build(cfg, mem, device, attention="sdpa"):
    model = GPTModel(cfg, memory=MemoryOptions(**mem), attention_backend=attention).to(device)
    with torch.no_grad():                       # speed: plain init is fine for a benchmark
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return model, opt


def document_ids(seq, device, mean_tokens=4096, seed=0):
    """[1, seq] int64 packed documents of random lengths (about `mean_tokens` each)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.rand(seq, generator=gen) < 1.0 / mean_tokens
    starts[0] = True
    return (torch.cumsum(starts.long(), 0) - 1)[None].to(device)


def step(model, opt, seq, vocab, device, account=False, documents=False):
    """One forward+backward+AdamW step; with account, (the saved-tensor report, the peak bytes
    allocated up to the end of backward, before the optimizer allocates its state)."""
    ids = torch.randint(0, vocab, (1, seq), device=device)
    docs = document_ids(seq, device) if documents else None
    acct = SavedTensorAccountant().attach(model) if account else None
    ctx = acct.recording() if acct else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids.roll(-1, 1), document_ids=docs).float().mean()
        loss.backward()
        backward_peak = torch.cuda.max_memory_allocated()   # autocast's bf16 copies still cached
    opt.step()
    opt.zero_grad(set_to_none=True)
    if acct:
        acct.detach()
        return acct.report(), backward_peak
    return None


def try_seq(cfg, mem, seq, device, timed_steps, attention="sdpa", documents=False):
    """(fits, seconds per step, peak GB, saved GB, activation peak GB) for one sequence length."""
    model = opt = None
    try:
        torch.cuda.empty_cache()
        model, opt = build(cfg, mem, device, attention)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()                  # the fp32 weights (and buffers)
        rep, backward_peak = step(model, opt, seq, cfg.vocab_size, device, account=True,
                                  documents=documents)
        act_gb = (backward_peak - before - 2 * cfg.num_parameters()) / 2**30
        torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(timed_steps):
            step(model, opt, seq, cfg.vocab_size, device, documents=documents)
        torch.cuda.synchronize()
        dt = (time.time() - t0) / max(timed_steps, 1)
        return (True, dt, torch.cuda.max_memory_allocated() / 2**30, rep["device_bytes"] / 2**30,
                act_gb)
    except torch.cuda.OutOfMemoryError:
        return False, None, None, None, None
    finally:
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()


def predicted_gb(cfg, mem, seq):
    """The planner's modelled bytes of this benchmark's step (GiB): fp32 weights, grads and AdamW
    state (16 bytes/param, unsharded), autocast's bf16 weight copies (2) + the activation peak
    under bf16 autocast (bf16 matmul inputs, fp32 residual stream); no reserve
    (max_memory_allocated holds none)."""
    state = model_state_bytes(cfg, sharding="none")["device"] + 2 * cfg.num_parameters()  # + bf16 copies
    return (state + predicted_activations_bytes(cfg, mem, seq)) / 2**30


def predicted_activations_bytes(cfg, mem, seq):
    """The planner's activation peak of one step (bf16 matmul inputs, fp32 residual stream)."""
    return step_peak_bytes(cfg, seq, 1, memory=MemoryOptions(**mem), dtype_bytes=2,
                           residual_bytes=4)["device"]


def step_seconds(cfg, mem, seq, peak_tflops, mfu=0.25):
    """A pessimistic estimate of one training step (model FLOPs at `mfu` of the peak, + 1/3 for
    full recompute), so that a try that cannot finish inside the time box is not started."""
    factor = 4 / 3 if mem.get("recompute_granularity") == "full" else 1.0
    return flops_for_config(cfg, 1, seq) * factor / ((peak_tflops or 400.0) * 1e12 * mfu)


def planner_max_seq(cfg, mem, device_gb, step=1024, fragmentation=0.10, reserve_gb=4.0):
    """Longest multiple of `step` whose modelled bytes x (1 + fragmentation) + reserve fit."""
    fits = lambda k: predicted_gb(cfg, mem, k * step) * (1 + fragmentation) + reserve_gb <= device_gb  # noqa: E731
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * step <= 1 << 24 and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def run_technique(cfg, name, args, device, peak, t_end):
    """Double the sequence from --start-seq while a step fits and the time box allows; one row."""
    mem = TECHNIQUES[name]
    seq, best, mfu, stopped = args.start_seq, None, {}, "max"
    while seq <= args.max_seq:
        timed = args.timed_steps if seq in (8192, 32768) else 0
        if time.time() + 10 + (1 + timed) * step_seconds(cfg, mem, seq, peak) > t_end:  # 10 s: build
            stopped = "time"            # the next try would run past this technique's time box
            break
        ok, dt, peak_gb, saved_gb, act_gb = try_seq(cfg, mem, seq, device, timed, args.attention,
                                                    args.documents)
        if not ok:
            stopped = "oom"
            break
        pred_gb = predicted_gb(cfg, mem, seq)
        pred_act_gb = predicted_activations_bytes(cfg, mem, seq) / 2**30
        best = (seq, peak_gb, saved_gb, pred_gb, act_gb, pred_act_gb)
        if timed and peak:
            mfu[seq] = flops_for_config(cfg, 1, seq) / dt / 1e12 / peak
        print(f"  {name:>15} seq {seq:>8}: peak {peak_gb:6.1f} GB (planner {pred_gb:6.1f} GB), "
              f"activations {act_gb:6.1f} GB (planner {pred_act_gb:6.1f} GB), "
              f"saved {saved_gb:6.2f} GB" + (f", {dt * 1e3:.0f} ms/step" if timed else ""), flush=True)
        seq *= 2
    device_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    return dict(technique=name, attention=args.attention, documents=args.documents,
                max_seq=best[0] if best else None, peak_gb=best[1] if best else None,
                planner_peak_gb=best[3] if best else None,
                activations_gb=best[4] if best else None,
                planner_activations_gb=best[5] if best else None,
                planner_max_seq=planner_max_seq(cfg, mem, device_gb), mfu_8k=mfu.get(8192),
                mfu_32k=mfu.get(32768), stopped=stopped)


def child_row(name, t_end, argv):
    """Run one technique in a fresh process (this script with --child); its row, or an error row."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", name, "--deadline", f"{t_end:.3f}"]
    row = None
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=max(30.0, t_end - time.time() + 60))    # + a step's overrun
        lines = proc.stdout.splitlines()
    except subprocess.TimeoutExpired as err:
        lines = (err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes)
                 else (err.stdout or "")).splitlines() + ["error: killed at the time box"]
    for ln in lines:
        if ln.startswith("ROW "):
            row = json.loads(ln[4:])
        else:
            print(ln, flush=True)
    if row is None:
        why = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), "no row")
        row = dict(technique=name, max_seq=None, peak_gb=None, planner_peak_gb=None,
                   activations_gb=None, planner_activations_gb=None,
                   planner_max_seq=0, mfu_8k=None, mfu_32k=None, stopped=f"error: {why.strip()[:80]}")
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--techniques", nargs="+", default=list(TECHNIQUES))
    p.add_argument("--start-seq", type=int, default=8192)
    p.add_argument("--max-seq", type=int, default=1 << 20)
    p.add_argument("--budget-s", type=float, default=450.0, help="whole run (stay under 8 minutes)")
    p.add_argument("--timed-steps", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--attention", default="sdpa", help="--attention-backend of the model (sdpa, flex)")
    p.add_argument("--documents", action="store_true",
                   help="packed documents (about 4K tokens each) through the attention backend")
    p.add_argument("--results", default="gpu_long_context_{gpu}",
                   help="bench/results/NAME.json in docs/performance.md's schema; '' writes nothing")
    p.add_argument("--results-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                         "results"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)      # one technique, then exit
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_long_context.py needs a CUDA GPU; use bench/long_context.py on CPU.")
        return 1
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = device_peak_tflops(args.peak_tflops)
    cfg = preset(args.model, max_position_embeddings=args.max_seq)
    if args.child:
        print("ROW " + json.dumps(run_technique(cfg, args.child, args, device, peak, args.deadline)))
        return 0
    print(f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} "
          f"GB), {args.model}: {cfg.num_parameters() / 1e9:.2f}B params, bf16 autocast, SDPA; "
          f"peak {peak} TFLOP/s", flush=True)
    start = time.time()
    rows = []
    for i, name in enumerate(args.techniques):
        # an equal share of what is left: time a technique did not use goes to the next ones
        per_tech = (start + args.budget_s - time.time()) / (len(args.techniques) - i)
        rows.append(child_row(name, min(start + args.budget_s, time.time() + per_tech), sys.argv[1:]))
        if args.json:                   # after every technique: a run cut short keeps its rows
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        if args.results:
            results_path = write_schema_rows(rows, args, cfg, peak)
    print(f"\n{'technique':>15} {'longest seq':>12} {'peak GB':>8} {'planner GB':>10} "
          f"{'act GB':>7} {'planner':>7} {'ratio':>6} {'planner longest':>15} {'MFU 8K':>7} "
          f"{'MFU 32K':>8}")
    for r in rows:
        pct = lambda v: f"{100 * v:.1f}%" if v else "-"  # noqa: E731
        gb = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
        act, pred = r.get("activations_gb"), r.get("planner_activations_gb")
        ratio = f"{pred / act:.2f}" if act and pred else "-"
        print(f"{r['technique']:>15} {str(r['max_seq'] or '-'):>12} {gb(r['peak_gb']):>8} "
              f"{gb(r['planner_peak_gb']):>10} {gb(act):>7} {gb(pred):>7} {ratio:>6} "
              f"{r['planner_max_seq']:>15} {pct(r['mfu_8k']):>7} {pct(r['mfu_32k']):>8}"
              f"   (stopped: {r['stopped']})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.results:
        print(f"wrote {results_path}")
    return 0


RESULT_COLUMNS = [("model", "model"), ("technique", "technique"), ("attention", "attention"),
                  ("documents", "documents"), ("longest_seq", "longest seq"),
                  ("planner_seq", "planner longest"), ("peak_memory_gib", "peak GiB"),
                  ("planner_peak_gib", "planner GiB"), ("mfu_8k", "MFU 8K"),
                  ("mfu_32k", "MFU 32K"), ("stopped", "stopped")]


def write_schema_rows(rows, args, cfg, peak) -> str:
    """bench/results/gpu_long_context_<gpu>[_flex][_documents].json (bench/performance_table.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from performance_table import device_info, write_results
    out = [{"model": args.model, "technique": r["technique"], "attention": r.get("attention"),
            "documents": r.get("documents"), "longest_seq": r["max_seq"],
            "planner_seq": r["planner_max_seq"], "peak_memory_gib": r["peak_gb"],
            "planner_peak_gib": r["planner_peak_gb"], "mfu_8k": r["mfu_8k"],
            "mfu_32k": r["mfu_32k"], "stopped": r["stopped"]} for r in rows]
    gpu = torch.cuda.get_device_name().split()[-1].lower() if torch.cuda.is_available() else "cpu"
    name = args.results.format(gpu=gpu) + ("" if args.attention == "sdpa" else f"_{args.attention}") \
        + ("_documents" if args.documents else "")
    return write_results(
        name, "gpu_long_context", out, columns=RESULT_COLUMNS,
        title=f"longest trainable sequence per technique, {args.model}"
              + (", packed documents" if args.documents else "") + f", {args.attention}",
        device=device_info(peak, "bf16 dense, megatron_sp.training.flops.PEAK_TFLOPS"),
        folder=args.results_dir,
        notes=[f"{cfg.num_parameters() / 1e9:.2f}B parameters, batch 1, bf16 autocast over fp32 "
               f"weights, fused AdamW; the sequence doubles from {args.start_seq}; planner longest: "
               f"modelled bytes + 10% + 4 GB reserve within the device"])


if __name__ == "__main__":
    sys.exit(main())
