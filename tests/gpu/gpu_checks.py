#!/usr/bin/env python3
"""Driver of the one GPU script (run it through tests/gpu/run_gpu_checks.sh, which installs the
project first). Everything in the project that needs a GPU, one line per item, in one time box.

    bash tests/gpu/run_gpu_checks.sh             # OUT=<folder> to choose where the JSON goes

Items, in order (each a subprocess with its own time limit, cut to what the time box has left):
  install        how the shell installed the project (pip editable, or the fallback finder)
  probe          versions (python, torch, CUDA, optional packages), `import megatron_sp.models,
                 megatron_sp.data` from outside the checkout, the sharding flags pretrain_gpt.py knows
  cuda tests     tests/gpu (bf16 vs fp32, SDPA flash kernel, RNG tracker, pinned offload, fused
                 AdamW, exact resume on device, TE and flash-attn backends): one row per test
  te, flash-attn "not installed", or the result of their backend test
  attention      three rows, each a subprocess of this file (`--attention KEY`), its rows saved
                 after every measurement and each measurement guarded (one failure or OOM does
                 not stop the others):
                   schemas    the aten kernels block_kernels.py calls, their schemas on this torch
                              and whether block_kernels' calls fit them (runs on CPU too)
                   kernels    forward + backward of the block kernels (blockwise_attention) vs
                              SDPA and FlexAttention at 8K, 32K, 128K tokens, bf16, b 1, h 32,
                              g 8, d 128, without and with 300 packed documents
                   rehearsal  the one-process ring (context_parallel/rehearsal.py) at 32K vs
                              per-document SDPA in fp32 (cp 4, 8; bf16 tolerances: out max abs
                              error 2e-2, gradients 5e-2 of their max), and one rank's peak
                              memory at 1M tokens, cp 8, beside the planner's ring buffers
                 kernels and rehearsal write bench/results/gpu_block_kernels_<gpu>.json and
                 gpu_ring_rehearsal_<gpu>.json
  nccl smoke     pretrain_gpt.py as a world of one over NCCL (torch.distributed.run): llama-1b at
                 8K, bf16, 6 iterations; its loss, ms/iter, MFU and peak memory are the unsharded row
  offload        pretrain_gpt.py, llama-1b at 32K, bf16, 4 iterations, --report-memory, full
                 recompute + --offload-activations four ways: the exact pinned host pool (default
                 sizing), --offload-pool-gb 0 (torch's pinned buffers), the pool with
                 --ulysses-head-chunks 2 and 4 (sp 1: the attention block over head groups); per row
                 the losses, peak device memory, host bytes, ms/iter and the planner's bytes
                 (bench/gpu_long_context.py's predicted_gb); pool vs no pool: losses equal (first
                 iteration bitwise, the rest within 1e-4 relative: the flash backward's atomics),
                 head chunks vs the pool row: last loss within 2e-2 relative (bf16); rows in
                 bench/results/gpu_offload_head_chunks_<gpu>.json; about 2.5 minutes at most
  long context   bench/gpu_long_context.py: MFU of llama-1b at 8K and 32K, the longest trainable
                 sequence per memory technique, the planner's prediction beside each measured peak
  throughput     bench/gpu_throughput.py: llama-1b and a Llama-3-8B-shaped model (as many layers as
                 fit) at 8K and 32K: eager vs compiled, SDPA vs flex (with and without documents),
                 ours vs Hugging Face LlamaForCausalLM on the same weights; MFU per row
  documents      bench/gpu_long_context.py --attention flex --documents: the longest llama-1b
                 sequence with packed documents through FlexAttention, beside the planner
  moe            bench/moe.py --bf16: the MoE layer against HF's Qwen3-MoE block (16K tokens, H 2048,
                 32 experts, top 8); rows in bench/results/gpu_moe.json
  sharded        the same run with --use-torch-fsdp2, --use-distributed-optimizer, and each with
                 --optimizer-cpu-offload ("not available" when pretrain_gpt.py lacks the flag)
  fp8            pretrain_gpt.py on 4 layers of Llama-3-8B shapes at 8K, bf16, 6 iterations, without
                 and with --fp8-format hybrid (torchao, tensorwise: torch._scaled_mm in qkv, out-proj,
                 fc1, fc2): ms/iter, tokens/s, MFU (the log line's: the FP8 row against the FP8 peak), the
                 last loss (FP8 within 2e-2 relative of bf16); rows in bench/results/gpu_fp8_<gpu>.json
                 ("not available" without torchao)

GPU_CHECKS_ONLY=key,key,... runs only those items (keys: cuda, schemas, kernels, rehearsal, nccl,
offload, long, throughput, documents, moe, sharded, fp8; install and probe always run), e.g.
`GPU_CHECKS_ONLY=cuda,schemas,kernels,rehearsal bash tests/gpu/run_gpu_checks.sh`.
Subprocesses run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless it is set (long
sequences: fewer unusable split blocks). Without CUDA every GPU item is skipped with one line, and
the run exits 0 (the CPU rehearsal, tests/gpu/test_rehearsal.py). A failed or timed-out item
makes the exit status 1. Results: $OUT/gpu_checks.json (rewritten after every item; OUT defaults to runs/gpu_checks) and a table;
the benches also write their rows under bench/results/ (docs/performance.md's schema: regenerate the
page with `python bench/performance_table.py` and commit both).
This file imports nothing from the project at its top: it must start before the project is
importable (the `--attention` subprocess modes import it inside their functions).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
OPTIONAL = ["numpy", "pytest", "pytest_timeout", "triton", "sentencepiece", "tokenizers",
            "transformers", "safetensors", "tqdm", "setuptools", "transformer_engine", "flash_attn",
            "apex", "torchao"]
SHARDED = [("fsdp2", ["--use-torch-fsdp2"]),
           ("distributed optimizer", ["--use-distributed-optimizer"]),
           ("fsdp2 + optimizer cpu offload", ["--use-torch-fsdp2", "--optimizer-cpu-offload"]),
           ("distopt + optimizer cpu offload", ["--use-distributed-optimizer",
                                                "--optimizer-cpu-offload"])]
RUN_ARGS = ["--model", "llama-1b", "--mock-data", "--seq-length", "8192", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "6", "--log-interval", "3",
            "--eval-iters", "0", "--bf16", "--lr", "1e-4", "--lr-warmup-iters", "0",
            "--lr-decay-iters", "6", "--attention-backend", "sdpa", "--distributed-backend", "nccl"]
# offload item (issue 36): the exact pinned host pool and Ulysses head chunks, one GPU
OFFLOAD_FLAGS = ("--offload-activations", "--offload-pool-gb", "--ulysses-head-chunks",
                 "--report-memory", "--recompute-granularity")
OFFLOAD_SEQ, OFFLOAD_ITERS = 32768, 4
OFFLOAD_BASE = ["--recompute-granularity", "full", "--offload-activations", "--report-memory"]
OFFLOAD_ROWS = [("pool", []),                                   # the planner sizes the pool
                ("no pool", ["--offload-pool-gb", "0"]),        # torch's pinned buffers
                ("pool + head chunks 2", ["--ulysses-head-chunks", "2"]),
                ("pool + head chunks 4", ["--ulysses-head-chunks", "4"])]
OFFLOAD_LIMIT = 150      # s for the whole item (4 runs of ~25-35 s on an H200 + the planner)
OFFLOAD_LATER = 270      # s left for the items after it (long context keeps its own 270)
OFFLOAD_ROW_S = (20, 75)  # s: a row starts with at least the first, runs at most the second
EXACT_REL_TOL = 1e-4     # pool vs no pool after the first iteration (bitwise there)
LOSS_REL_TOL = 2e-2      # bf16 loss tolerance (tests/gpu/test_cuda_paths.py)

PROBE = r"""
import importlib, importlib.util, json, os, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable, "versions": {}}
import torch
out["versions"]["torch"] = torch.__version__
out["cuda_build"] = torch.version.cuda
out["cuda"] = torch.cuda.is_available()
if out["cuda"]:
    p = torch.cuda.get_device_properties(0)
    out["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB"
    try:
        v = torch.cuda.nccl.version()                 # a tuple, or an int in older releases
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as err:
        out["nccl"] = f"unknown ({err})"[:80]
for name in sys.argv[1].split(","):
    try:
        mod = importlib.import_module(name)
        out["versions"][name] = getattr(mod, "__version__", "installed")
    except Exception as err:                 # ImportError, or a broken build raising anything
        out["versions"][name] = None if isinstance(err, ImportError) else f"broken: {err}"[:120]
import megatron_sp, megatron_sp.models, megatron_sp.data
out["megatron_sp"] = os.path.dirname(megatron_sp.__file__)
from megatron_sp.cli.arguments import build_parser
known = build_parser()._option_string_actions
out["flags"] = {f: f in known for f in sys.argv[2].split(",")}
for key, path in (("bench_import", sys.argv[3]), ("throughput_import", sys.argv[4])):
    try:                                              # the benches' imports resolve
        sys.path.insert(0, os.path.dirname(path))
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        out[key] = "ok"
    except Exception as err:
        out[key] = f"{type(err).__name__}: {err}"[:200]
print("PROBE " + json.dumps(out))
"""


class Checks:
    """Items with a shared deadline; results kept in order, saved after every item."""

    def __init__(self, out_dir: str, budget_s: float, start: float):
        self.out_dir, self.deadline, self.start = out_dir, start + budget_s, start
        self.items: list[dict] = []
        self.extra: dict = {}
        os.makedirs(out_dir, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def add(self, name: str, status: str, detail: str = "", seconds: float = 0.0, **data) -> None:
        item = {"item": name, "status": status, "detail": detail, "seconds": round(seconds, 1), **data}
        self.items.append(item)
        print(f"[{time.time() - self.start:6.0f}s] {name:<34} {status:<14} {detail}", flush=True)
        self.save()

    def save(self) -> None:
        with open(os.path.join(self.out_dir, "gpu_checks.json"), "w") as fh:
            json.dump({"items": self.items, **self.extra}, fh, indent=1)

    def run(self, cmd: list[str], limit: float, reserve: float = 0.0, log: str | None = None,
            cwd: str = ROOT) -> tuple[str, float, str]:
        """Run cmd within min(limit, time left - reserve): ("ok" | "failed" | "timeout" | "no time",
        seconds, output tail). Output goes to OUT/<log>.log in full."""
        timeout = min(limit, self.left() - reserve)
        if timeout < 5:
            return "no time", 0.0, ""
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout, env=_env())
            status, text = ("ok" if proc.returncode == 0 else "failed"), proc.stdout
        except subprocess.TimeoutExpired as err:
            status = "timeout"
            text = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        if log:
            with open(os.path.join(self.out_dir, f"{log}.log"), "w") as fh:
                fh.write(text)
        return status, time.time() - t0, text


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def _failure(text: str) -> str:
    """The line that says why a run failed: our one-sentence `error: ...`, else the last exception
    line that is not torchrun's own wrapper, else the last lines."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    ours = [ln for ln in lines if ln.lower().startswith("error:") or "error: " in ln[:40]]
    errors = [ln for ln in lines if ("Error" in ln or "Exception" in ln) and "elastic" not in ln
              and "ChildFailedError" not in ln and "errors.html" not in ln]
    return (ours or errors or [_tail(text, 2)])[-1][:200]


def _tail(text: str, n: int = 1) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[:200]


# Items --------------------------------------------------------------------------------------------

def probe(c: Checks) -> dict | None:
    flags = sorted({f for _, fl in SHARDED for f in fl} | set(OFFLOAD_FLAGS))
    with tempfile.TemporaryDirectory() as cwd:              # outside the checkout: proves the install
        status, dt, text = c.run([PY, "-c", PROBE, ",".join(OPTIONAL), ",".join(flags),
                                  os.path.join(ROOT, "bench", "gpu_long_context.py"),
                                  os.path.join(ROOT, "bench", "gpu_throughput.py")],
                                 120, log="probe", cwd=cwd)
    line = next((ln for ln in text.splitlines() if ln.startswith("PROBE ")), None)
    if status != "ok" or line is None:
        c.add("probe (versions, import)", "FAILED", _failure(text), dt)
        return None
    info = json.loads(line[6:])
    c.extra["environment"] = info
    v = info["versions"]
    c.add("probe (versions, import)", "ok",
          f"python {info['python']}, torch {v['torch']} (CUDA build {info['cuda_build']}), "
          f"megatron_sp from {info['megatron_sp']}", dt)
    print("  versions: " + ", ".join(f"{k} {val or 'not installed'}" for k, val in v.items()))
    print(f"  device: {info.get('device', 'no CUDA device')}" + (f", NCCL {info['nccl']}"
                                                                  if info.get("nccl") else ""))
    return info


def cuda_tests(c: Checks, info: dict) -> dict:
    xml = os.path.join(c.out_dir, "cuda_tests.xml")
    status, dt, text = c.run([PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                              "tests/gpu", "--ignore=tests/gpu/test_rehearsal.py",
                              f"--junitxml={xml}"], 180, reserve=240, log="cuda_tests")
    results = _junit(xml) if os.path.exists(xml) else {}
    if not info["cuda"]:
        c.add("cuda tests", "skipped", f"no CUDA device ({len(results)} tests collected, "
              f"pytest {status})", dt)
        return results
    if status in ("timeout", "no time") or not results:
        c.add("cuda tests", "FAILED" if status == "failed" else status, _failure(text), dt)
        return results
    for name, (res, msg) in results.items():
        c.add(f"  {name}", {"passed": "ok", "failed": "FAILED"}.get(res, res), msg)
    return results


def _junit(path: str) -> dict:
    """{test name: (passed | failed | skipped, message)} from pytest's junit XML."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        res, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                res = "skipped" if tag == "skipped" else "failed"
                msg = (node.get("message") or "").splitlines()[0][:150] if node.get("message") else ""
        out[case.get("name")] = (res, msg)
    return out


def fused_backends(c: Checks, info: dict, results: dict) -> None:
    for label, module, test in (("transformer engine", "transformer_engine", "te"),
                                ("flash-attn", "flash_attn", "flash")):
        version = info["versions"].get(module)
        if not version:
            c.add(label, "not installed", "optional: --attention-backend auto falls back to SDPA")
            continue
        rows = {k: v for k, v in results.items() if f"{test}-{module}" in k}
        if not info["cuda"]:
            c.add(label, "skipped", f"{version}; no CUDA device")
        elif rows and all(r == "passed" for r, _ in rows.values()):
            c.add(label, "ok", f"{version}; {', '.join(rows)} passed")
        else:
            c.add(label, "FAILED", f"{version}; " + "; ".join(f"{k}: {r} {m}" for k, (r, m) in rows.items()))


def pretrain_run(c: Checks, name: str, extra: list[str], limit: float, reserve: float) -> dict:
    """pretrain_gpt.py as a world of one over NCCL; the last metrics record, or a status."""
    tag = name.replace(" ", "_").replace("+", "").replace("__", "_")
    jsonl = os.path.join(c.out_dir, f"run_{tag}.jsonl")
    if os.path.exists(jsonl):
        os.remove(jsonl)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "pretrain_gpt.py", *RUN_ARGS, *extra, "--metrics-jsonl", jsonl]
    status, dt, text = c.run(cmd, limit, reserve=reserve, log=f"run_{tag}")
    records = []
    if os.path.exists(jsonl):
        with open(jsonl) as fh:
            records = [json.loads(ln) for ln in fh if ln.strip()]
    last = records[-1] if records else {}
    row = {"mode": name, "status": status, "seconds": round(dt, 1), "lm_loss": last.get("lm_loss"),
           "ms_per_iter": last.get("ms_per_iter"), "mfu": last.get("mfu"),
           "mem_peak_gb": last.get("mem_peak_gb")}
    if status == "ok" and last:
        detail = (f"loss {last['lm_loss']:.4f}, {last['ms_per_iter']:.0f} ms/iter, MFU "
                  f"{100 * last.get('mfu', 0):.1f}%, peak {last.get('mem_peak_gb', 0):.1f} GB")
    else:
        detail = _failure(text) if status == "failed" else _tail(text, 2)
    c.add(name, {"ok": "ok", "failed": "FAILED"}.get(status, status), detail, dt, run=row)
    return row


def nccl_and_sharded(c: Checks, info: dict, first: bool) -> None:
    """first: the NCCL smoke run (the unsharded reference); else the sharded modes after it."""
    if first:
        if not info["cuda"]:
            c.add("nccl smoke (llama-1b 8K, world of 1)", "skipped", "no CUDA device")
            return
        c.extra["sharded"] = [pretrain_run(c, "nccl smoke (llama-1b 8K, world of 1)", [], 150, 200)]
        return
    for name, flags in SHARDED:
        missing = [f for f in flags if not info["flags"].get(f)]
        if missing:
            c.add(name, "not available", f"pretrain_gpt.py does not know {' '.join(missing)}")
        elif not info["cuda"]:
            c.add(name, "skipped", "no CUDA device")
        else:
            row = pretrain_run(c, name, flags, 100, 10)
            c.extra.setdefault("sharded", []).append(row)


FP8_MODEL = ["--model", "llama-8b", "--num-layers", "4"]   # 8B-shaped layers at RUN_ARGS' 8K
FP8_ROWS = [("bf16 (llama-8b shapes x4, 8K)", FP8_MODEL),
            ("fp8 hybrid tensorwise (torchao)", FP8_MODEL + ["--fp8-format", "hybrid"])]


def fp8_rows(c: Checks, info: dict) -> None:
    """The fp8 item (docstring): bf16 and FP8 through pretrain_gpt.py, their last losses compared,
    rows in bench/results/gpu_fp8_<gpu>.json."""
    if not info["cuda"]:
        c.add("fp8 vs bf16", "skipped", "no CUDA device")
        return
    if not info["versions"].get("torchao"):
        c.add("fp8 vs bf16", "not available", "torchao is not installed (pip install torchao)")
        return
    rows = [pretrain_run(c, name, flags, 150, 10) for name, flags in FP8_ROWS]
    losses = [r.get("lm_loss") for r in rows]
    if all(v is not None for v in losses):
        rel = _rel(losses[1], losses[0])
        c.add("fp8 vs bf16 last loss", "ok" if 0 < rel <= LOSS_REL_TOL else "FAILED",
              f"relative difference {rel:.2e} (tolerance {LOSS_REL_TOL:g}, and not 0)", 0.0)
    ok = [r for r in rows if r.get("status") == "ok"]
    if ok:
        name = info.get("device", "gpu").split(",")[0]
        gpu = name.split()[-1].lower() if name else "gpu"
        record = {"schema": 1, "bench": "gpu_fp8", "title": "pretrain_gpt.py, 4 layers of "
                  "Llama-3-8B shapes at 8K: bf16 vs FP8 linears (torchao)",
                  "device": {"kind": "gpu", "name": name, "peak_tflops": None,
                             "peak_note": "MFU from the training log line (bf16 dense "
                                          "peak; the FP8 row: the FP8 dense peak)"},
                  "torch": info["versions"].get("torch"), "command": "GPU_CHECKS_ONLY=fp8 bash "
                  "tests/gpu/run_gpu_checks.sh", "date": time.strftime("%Y-%m-%d"),
                  "columns": [["layout", "run"], ["lm_loss", "lm loss"], ["ms_per_iter", "ms/iter"],
                              ["tokens_per_s", "tokens/s"], ["mfu", "MFU"],
                              ["peak_memory_gib", "peak GiB"]],
                  "rows": [{"layout": r["mode"], "lm_loss": r["lm_loss"],
                            "ms_per_iter": r["ms_per_iter"],
                            "tokens_per_s": 8192 / (r["ms_per_iter"] / 1e3) if r["ms_per_iter"]
                            else None, "mfu": r["mfu"], "peak_memory_gib": r["mem_peak_gb"]}
                           for r in ok],
                  "notes": ["micro-batch 1, 6 iterations, the last logged record; FP8 in qkv, "
                            "out-proj, fc1, fc2 only"]}
        path = os.path.join(ROOT, "bench", "results", f"gpu_fp8_{gpu}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(record, fh, indent=1)
        os.replace(path + ".tmp", path)


def long_context(c: Checks, info: dict) -> None:
    if info.get("bench_import") != "ok":
        c.add("long context (MFU, longest seq)", "FAILED", f"bench import: {info.get('bench_import')}")
        return
    if not info["cuda"]:
        c.add("long context (MFU, longest seq)", "skipped", "no CUDA device")
        return
    budget = max(60.0, min(300.0, c.left() - 4 * 60 - 30))
    out_json = os.path.join(c.out_dir, "long_context.json")
    status, dt, text = c.run([PY, "bench/gpu_long_context.py", "--budget-s", f"{budget:.0f}",
                              "--json", out_json], budget + 90, log="long_context")
    rows = []
    if os.path.exists(out_json):
        with open(out_json) as fh:
            rows = json.load(fh)
    c.extra["long_context"] = rows
    best = max((r for r in rows if r.get("max_seq")), key=lambda r: r["max_seq"], default=None)
    mfu = next((r for r in rows if r.get("mfu_8k")), None)
    detail = (f"longest {best['max_seq']} ({best['technique']})" if best else _failure(text))
    if mfu:
        detail += f"; MFU 8K {100 * mfu['mfu_8k']:.1f}%" + (
            f", 32K {100 * mfu['mfu_32k']:.1f}%" if mfu.get("mfu_32k") else "")
    ratios = [r["planner_activations_gb"] / r["activations_gb"] for r in rows
              if r.get("activations_gb") and r.get("planner_activations_gb")]
    if ratios:
        detail += f"; planner/measured activations {min(ratios):.2f}-{max(ratios):.2f}"
    c.add("long context (MFU, longest seq)", {"ok": "ok", "failed": "FAILED"}.get(status, status),
          detail, dt)
    print(_bench_table(text))


def throughput(c: Checks, info: dict) -> None:
    """bench/gpu_throughput.py in what the time box allows (rows it does not reach: "no time")."""
    name = "throughput (compile, flex, vs HF)"
    if info.get("throughput_import") != "ok":
        c.add(name, "FAILED", f"bench import: {info.get('throughput_import')}")
        return
    if not info["cuda"]:
        c.add(name, "skipped", "no CUDA device")
        return
    budget = max(60.0, min(240.0, c.left() - 3 * 60))
    status, dt, text = c.run([PY, "bench/gpu_throughput.py", "--budget-s", f"{budget:.0f}"],
                             budget + 120, log="throughput")
    rows = [ln for ln in text.splitlines() if "tok/s" in ln or "not available" in ln]
    ok = [ln for ln in rows if ln.rstrip().endswith(" ok")]
    c.add(name, {"ok": "ok", "failed": "FAILED"}.get(status, status),
          f"{len(ok)} of {len(rows)} rows measured" if rows else _failure(text), dt)
    print("\n".join(rows))


def documents_longest(c: Checks, info: dict) -> None:
    """The longest llama-1b sequence with packed documents through flex, beside the planner."""
    name = "longest with documents (flex)"
    if not info["cuda"]:
        c.add(name, "skipped", "no CUDA device")
        return
    budget = max(60.0, min(120.0, c.left() - 2 * 60))
    status, dt, text = c.run([PY, "bench/gpu_long_context.py", "--techniques", "all",
                              "--attention", "flex", "--documents", "--start-seq", "32768",
                              "--budget-s", f"{budget:.0f}"], budget + 90, log="documents")
    c.add(name, {"ok": "ok", "failed": "FAILED"}.get(status, status),
          _tail(_bench_table(text), 1) or _failure(text), dt)


def moe_layer(c: Checks, info: dict) -> None:
    """bench/moe.py in bf16 on the GPU: the MoE layer (grouped mm, loop) against HF's Qwen3-MoE
    block at Qwen3-30B-A3B's width (H 2048, F 768, top 8 of 32 experts here), 16K tokens."""
    name = "moe layer vs HF (bf16)"
    if not info["cuda"]:
        c.add(name, "skipped", "no CUDA device")
        return
    status, dt, text = c.run([PY, "bench/moe.py", "--bf16", "--tokens", "16384", "--hidden",
                              "2048", "--ffn", "768", "--experts", "32", "--topk", "8"],
                             min(150.0, max(30.0, c.left() - 60)), log="moe")
    rows = [ln for ln in text.splitlines() if ln.startswith(("HF ", "ours"))]
    c.add(name, {"ok": "ok", "failed": "FAILED"}.get(status, status),
          " | ".join(" ".join(r.split()) for r in rows) if rows else _failure(text), dt)


def _override(args: list[str], values: dict) -> list[str]:
    """args with each flag's value replaced (a flag not in args is appended with its value)."""
    out = list(args)
    for flag, value in values.items():
        if flag in out:
            out[out.index(flag) + 1] = str(value)
        else:
            out += [flag, str(value)]
    return out


def offload_args(seq: int = OFFLOAD_SEQ, iters: int = OFFLOAD_ITERS, base: list | None = None,
                 **values) -> list[str]:
    """pretrain_gpt.py's flags common to the offload item's rows: RUN_ARGS (llama-1b, bf16, mock
    data, NCCL) at `seq` tokens for `iters` iterations, logged every iteration, full recompute +
    --offload-activations + --report-memory; `values`: more flags replaced (flag: value)."""
    args = _override(base or RUN_ARGS, {"--seq-length": seq, "--train-iters": iters,
                                        "--log-interval": 1, "--lr-decay-iters": iters, **values})
    return args + OFFLOAD_BASE


OFFLOAD_PLAN = r"""
import json, os, sys, types
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import pretrain_gpt
from gpu_long_context import predicted_activations_bytes, predicted_gb
from megatron_sp.memory import MemoryOptions
from megatron_sp.memory.planner import step_peak_bytes
out = {}
for label, argv in json.loads(sys.argv[1]).items():
    try:
        job, _ = pretrain_gpt.load_job(argv)
        cfg = pretrain_gpt.model_config(job, pretrain_gpt.build_tokenizer(job, None).vocab_size)
        mem = MemoryOptions.from_config(job.memory)
        seq = job.training.seq_length
        if job.memory.offload_pool_gb == 0:           # torch's pinned buffers: powers of two
            host = step_peak_bytes(cfg, seq, job.training.micro_batch_size, memory=mem,
                                   dtype_bytes=2, residual_bytes=4, device="cuda")["host"]
        else:                                         # what pretrain_gpt.py sizes the pool to
            mesh = types.SimpleNamespace(tp_size=1, sp_size=1, cp_size=1, pp_size=1)
            host = (job.memory.offload_pool_gb * 2**30 if job.memory.offload_pool_gb
                    else pretrain_gpt.offload_pool_bytes(cfg, mesh, job))
        out[label] = {"planner_peak_gib": round(predicted_gb(cfg, mem.to_dict(), seq), 3),
                      "planner_activations_gib": round(predicted_activations_bytes(
                          cfg, mem.to_dict(), seq) / 2**30, 3),
                      "planner_host_gib": round(host / 2**30, 3)}
    except Exception as err:
        out[label] = {"planner_error": f"{type(err).__name__}: {err}"[:160]}
print("PLAN " + json.dumps(out))
"""


def _offload_planner(c: Checks, argvs: dict, limit: float) -> dict:
    """{label: the planner's bytes for that row's pretrain_gpt.py flags}: the long-context item's
    helpers (bench/gpu_long_context.py predicted_gb, predicted_activations_bytes: fp32 state, bf16
    copies, the step's activation peak) and the host bytes (pretrain_gpt.offload_pool_bytes for
    the pool, step_peak_bytes' power-of-two count for torch's pinned buffers). {} on a failure."""
    status, dt, text = c.run([PY, "-c", OFFLOAD_PLAN, json.dumps(argvs)], limit,
                             log="offload_planner")
    line = next((ln for ln in text.splitlines() if ln.startswith("PLAN ")), None)
    if line is None:
        print(f"  planner: {status}: {_failure(text)}")
        return {}
    return json.loads(line[5:])


def _float_after(text: str, label: str) -> float | None:
    """The number after the last `label` in text (a log line's field), else None."""
    at = text.rfind(label)
    if at < 0:
        return None
    word = text[at + len(label):].split()[0].strip("|,") if text[at + len(label):].split() else ""
    try:
        return float(word)
    except ValueError:
        return None


def _offload_row(c: Checks, label: str, argv: list[str], limit: float, launcher: list[str]) -> dict:
    """One pretrain_gpt.py run of the offload item: its row (status ok | OOM | failed: ... |
    timeout | no time; the losses of every iteration, peak device memory, host bytes, ms/iter)."""
    tag = "offload_" + label.replace(" + ", "_").replace(" ", "_")
    jsonl = os.path.join(c.out_dir, f"run_{tag}.jsonl")
    if os.path.exists(jsonl):
        os.remove(jsonl)
    cmd = [*launcher, "pretrain_gpt.py", *argv, "--metrics-jsonl", jsonl]
    row = {"mode": label, "seq": int(argv[argv.index("--seq-length") + 1]),
           "head_chunks": int(argv[argv.index("--ulysses-head-chunks") + 1])
           if "--ulysses-head-chunks" in argv else 1,
           "pool": "--offload-pool-gb" not in argv or float(
               argv[argv.index("--offload-pool-gb") + 1]) != 0,
           "command": " ".join(["pretrain_gpt.py", *argv])}
    status, dt, text = c.run(cmd, limit, log=f"run_{tag}")
    row["seconds"] = round(dt, 1)
    records = []
    if os.path.exists(jsonl):
        with open(jsonl) as fh:
            records = [json.loads(ln) for ln in fh if ln.strip()]
    records = [r for r in records if r.get("lm_loss") is not None]
    last = records[-1] if records else {}
    lines = [ln for ln in text.splitlines() if "lm loss:" in ln]
    log_line = lines[-1] if lines else ""
    pool_line = next((ln for ln in text.splitlines() if "exact pinned host pool of" in ln), "")
    row.update({"iterations": len(records), "lm_loss": last.get("lm_loss"),
                "losses": [r["lm_loss"] for r in records], "ms_per_iter": last.get("ms_per_iter"),
                "mfu": last.get("mfu"),
                "peak_device_gib": _float_after(log_line, "peak device memory (GB):"),
                "mem_peak_gb": last.get("mem_peak_gb"),
                "host_pool_gib": _float_after(pool_line, "exact pinned host pool of"),
                "offloaded_bytes_per_rank": last.get("offloaded_bytes_per_rank"),
                "saved_bytes_per_rank": last.get("saved_bytes_per_rank")})
    if row["peak_device_gib"] is None:
        row["peak_device_gib"] = row["mem_peak_gb"]
    if status == "ok" and not records:
        row["status"] = "failed: no metrics record"
    elif status == "ok":
        row["status"] = "ok"
    elif status == "failed":
        row["status"] = "OOM" if "OutOfMemoryError" in text else f"failed: {_failure(text)}"[:200]
    else:
        row["status"] = status
    shown = {k: v for k, v in row.items() if k not in ("command", "losses")}
    print("  " + ", ".join(f"{k} {_fmt(v)}" for k, v in shown.items()), flush=True)
    return row


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _offload_compare(rows: list[dict]) -> None:
    """Into the rows: no pool vs the pool row (offload is exact: the first iteration's loss
    bitwise, every later one within EXACT_REL_TOL), head chunks vs the pool row (the last loss
    within LOSS_REL_TOL, bf16). A row that breaks its check gets status failed: ..."""
    ref = next((r for r in rows if r["mode"] == "pool"), None)
    if ref is None or ref.get("status") != "ok":
        return
    for r in rows:
        if r is ref or r.get("status") != "ok":
            continue
        r["compared_with"] = "pool"
        if not r["head_chunks"] > 1:                   # the same run without the pool: exact
            n = min(len(r["losses"]), len(ref["losses"]))
            rels = [_rel(a, b) for a, b in zip(r["losses"][:n], ref["losses"][:n])]
            r["loss_bitwise_equal"] = r["losses"] == ref["losses"]
            r["loss_max_rel_diff"] = max(rels) if rels else None
            r["tolerance"] = f"first loss bitwise, then {EXACT_REL_TOL} relative"
            if not n or len(r["losses"]) != len(ref["losses"]):
                r["status"] = "failed: not the pool row's iterations"
            elif r["losses"][0] != ref["losses"][0] or max(rels) > EXACT_REL_TOL:
                r["status"] = (f"failed: losses differ from the pool row's (max rel "
                               f"{max(rels):.2e})")
        else:
            rel = _rel(r["lm_loss"], ref["lm_loss"])
            r["loss_rel_diff"] = rel
            r["tolerance"] = f"last loss {LOSS_REL_TOL} relative (bf16)"
            if rel > LOSS_REL_TOL:
                r["status"] = f"failed: last loss {rel:.2e} relative off the pool row's"


def _offload_summary(rows: list[dict]) -> str:
    by = {r["mode"]: r for r in rows}
    parts = []
    ref = by.get("pool")
    if ref and ref.get("status") == "ok":
        parts.append(f"pool loss {ref['lm_loss']:.4f}, {ref['ms_per_iter'] or 0:.0f} ms/iter"
                     + (f", peak {ref['peak_device_gib']:.1f} GB" if ref.get("peak_device_gib")
                        is not None else "")
                     + (f", pool {ref['host_pool_gib']:.2f} GiB" if ref.get("host_pool_gib")
                        is not None else ""))
    nopool = by.get("no pool")
    if nopool and nopool.get("loss_max_rel_diff") is not None:
        parts.append("no pool: " + ("losses bitwise equal" if nopool["loss_bitwise_equal"] else
                                    f"loss rel {nopool['loss_max_rel_diff']:.1e}")
                     + f", {nopool['ms_per_iter'] or 0:.0f} ms/iter")
    chunks = [r for r in rows if r["head_chunks"] > 1 and r.get("loss_rel_diff") is not None]
    if chunks:
        parts.append("chunks " + "/".join(str(r["head_chunks"]) for r in chunks) + ": loss rel "
                     + "/".join(f"{r['loss_rel_diff']:.1e}" for r in chunks)
                     + (", peak " + "/".join(f"{r['peak_device_gib']:.1f}" for r in chunks) + " GB"
                        if all(r.get("peak_device_gib") is not None for r in chunks) else ""))
    return "; ".join(parts)


def offload_rows(c: Checks, argv_for: dict, t_end: float, launcher: list[str]) -> list[dict]:
    """The offload item's rows (argv_for: {label: pretrain_gpt.py flags}, in order), each run
    within its share of what is left before t_end, compared, the planner's bytes beside them,
    saved into c.extra["offload_head_chunks"] after every row."""
    rows: list[dict] = []
    c.extra["offload_head_chunks"] = rows
    labels = list(argv_for)
    for i, label in enumerate(labels):
        left = min(t_end, c.deadline) - time.time()
        limit = min(OFFLOAD_ROW_S[1], left - OFFLOAD_ROW_S[0] * (len(labels) - i - 1))
        if limit < OFFLOAD_ROW_S[0]:
            argv = argv_for[label]
            rows.append({"mode": label, "status": "no time",
                         "head_chunks": int(argv[argv.index("--ulysses-head-chunks") + 1])
                         if "--ulysses-head-chunks" in argv else 1})
            print(f"  {label}: no time")
            continue
        rows.append(_offload_row(c, label, argv_for[label], limit, launcher))
        c.save()
    _offload_compare(rows)
    left = min(t_end, c.deadline) - time.time()
    if left >= 10:
        plan = _offload_planner(c, {r["mode"]: argv_for[r["mode"]] for r in rows}, min(45, left))
        for r in rows:
            r.update(plan.get(r["mode"], {}))
    c.save()
    return rows


def offload_head_chunks(c: Checks, info: dict) -> None:
    """The exact pinned host pool vs torch's pinned buffers, and Ulysses head chunks (2, 4) on
    the pool, through pretrain_gpt.py on one GPU (issue 36): rows, checks, the planner beside."""
    name = f"offload pool + head chunks ({OFFLOAD_SEQ // 1024}K)"
    if not info["cuda"]:
        c.add(name, "skipped", "no CUDA device")
        return
    missing = [f for f in OFFLOAD_FLAGS if not info["flags"].get(f)]
    if missing:
        c.add(name, "not available", f"pretrain_gpt.py does not know {' '.join(missing)}")
        return
    t0 = time.time()
    budget = max(100.0, min(OFFLOAD_LIMIT, c.left() - OFFLOAD_LATER))
    try:
        argv_for = {label: offload_args() + extra for label, extra in OFFLOAD_ROWS}
        rows = offload_rows(c, argv_for, t0 + budget,
                            [PY, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "1"])
    except Exception as err:                 # noqa: BLE001 - the item says what; the rest runs
        c.add(name, "FAILED", f"{type(err).__name__}: {err}"[:200], time.time() - t0)
        return
    bad = [r for r in rows if r["status"].startswith("failed") or r["status"] == "OOM"]
    ok = [r for r in rows if r["status"] == "ok"]
    status = ("FAILED" if bad else "timeout" if any(r["status"] == "timeout" for r in rows)
              else "ok" if ok else "no time")
    detail = f"{len(ok)} of {len(rows)} rows ok"
    if bad:
        detail += f"; {bad[0]['mode']}: {bad[0]['status']}"
    summary = _offload_summary(rows)
    if summary:
        detail += f"; {summary}"
    c.add(name, status, detail[:200], time.time() - t0)
    offload_results(info, rows)


def offload_results(info: dict, rows: list[dict]) -> None:
    """The offload item's rows as bench/results/gpu_offload_head_chunks_<gpu>.json (docs/
    performance.md's schema, written without importing the project, as pretrain_results)."""
    rows = [r for r in rows if r.get("status") not in ("no time",)]
    if not info or not info.get("cuda") or not any(r.get("lm_loss") is not None for r in rows):
        return
    name = info.get("device", "gpu").split(",")[0]
    keys = ("mode", "seq", "head_chunks", "status", "lm_loss", "ms_per_iter", "peak_device_gib",
            "planner_peak_gib", "host_pool_gib", "offloaded_bytes_per_rank", "planner_host_gib",
            "loss_max_rel_diff", "loss_rel_diff")
    record = {"schema": 1, "bench": "gpu_offload_head_chunks",
              "title": f"pretrain_gpt.py, llama-1b at {OFFLOAD_SEQ // 1024}K, one GPU: full "
                       "recompute + offloaded activations in the exact pinned host pool, in "
                       "torch's pinned buffers, and with Ulysses head chunks",
              "device": {"kind": "gpu", "name": name, "peak_tflops": None,
                         "peak_note": "MFU from the training log line (flops.PEAK_TFLOPS)"},
              "torch": info["versions"].get("torch"), "command": "bash tests/gpu/run_gpu_checks.sh",
              "date": time.strftime("%Y-%m-%d"),
              "columns": [["mode", "offload"], ["seq", "seq"], ["head_chunks", "head chunks"],
                          ["lm_loss", "lm loss"], ["ms_per_iter", "ms/iter"],
                          ["peak_device_gib", "peak GiB"], ["planner_peak_gib", "planner GiB"],
                          ["host_pool_gib", "host pool GiB"],
                          ["offloaded_bytes_per_rank", "offloaded bytes"],
                          ["planner_host_gib", "planner host GiB"],
                          ["loss_max_rel_diff", "loss rel (no pool)"],
                          ["loss_rel_diff", "loss rel (chunks)"], ["status", "status"]],
              "rows": [{k: r.get(k) for k in keys} for r in rows],
              "notes": [f"bf16, micro-batch 1, {OFFLOAD_ITERS} iterations, --report-memory; the "
                        "last iteration's record; world of 1 over NCCL (sp 1: head chunks run "
                        "the local attention over head groups)",
                        f"pool vs no pool: first loss bitwise, then {EXACT_REL_TOL} relative; "
                        f"head chunks vs the pool row: {LOSS_REL_TOL} relative (bf16)",
                        "planner: bench/gpu_long_context.py predicted_gb (fp32 state, bf16 "
                        "copies, the step's activation peak; no reserve); host: the pool's size "
                        "(pretrain_gpt.offload_pool_bytes) or step_peak_bytes' power-of-two "
                        "pinned count"]}
    gpu = name.split()[-1].lower() if name else "gpu"
    path = os.path.join(ROOT, "bench", "results", f"gpu_offload_head_chunks_{gpu}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh, indent=1)
    os.replace(path + ".tmp", path)


def _bench_table(text: str) -> str:
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip().startswith("technique")), None)
    return "\n".join(lines[start:]) if start is not None else ""


# Attention items (block kernels, ring rehearsal) -------------------------------------------------
#
# Each runs as `gpu_checks.py --attention KEY --json PATH --budget-s N` in its own process (the
# project imported there, not here); every measurement is one row, guarded (an error or an OOM
# is that row's status) and saved at once, so a timeout keeps what was measured.

ONLY_KEYS = ("cuda", "schemas", "kernels", "rehearsal", "nccl", "offload", "long", "throughput",
             "documents", "moe", "sharded", "fp8")
# key: (item name, needs CUDA, time limit s)
ATTENTION_ITEMS = {
    "schemas": ("aten attention schemas", False, 60),
    "kernels": ("block kernels vs sdpa/flex (bf16)", True, 200),
    "rehearsal": ("ring rehearsal (32K docs, 1M peak)", True, 150),
}
LATER_RESERVE = 240      # s kept for the pretrain_gpt.py / bench items when they are selected
ATTENTION_OPS = {   # what block_kernels.py passes: positional arguments, keywords
    "_flash_attention_forward": (10, {"scale"}),
    "_flash_attention_backward": (14, {"scale"}),
    "_scaled_dot_product_efficient_attention": (7, {"scale"}),
    "_scaled_dot_product_efficient_attention_backward": (12, {"scale"}),
}
KERNEL_SIZES = (8192, 32768, 131072)
KERNEL_SHAPE = (32, 8, 128)          # h, g, d
DOCUMENTS = 300                      # "hundreds" of packed documents
SDPA_MASK_MAX = 32768                # SDPA with documents takes an s x s mask: not past this
REHEARSAL_SEQ, REHEARSAL_CPS = 32768, (4, 8)
PEAK_SEQ, PEAK_CP = 1 << 20, 8
OUT_TOL, GRAD_REL_TOL = 2e-2, 5e-2   # bf16 rehearsal vs fp32 reference


def _selected() -> set:
    raw = os.environ.get("GPU_CHECKS_ONLY", "").strip()
    if not raw:
        return set(ONLY_KEYS)
    keys = {k.strip() for k in raw.split(",") if k.strip()}
    unknown = keys - set(ONLY_KEYS)
    if unknown:
        print(f"  GPU_CHECKS_ONLY: unknown {', '.join(sorted(unknown))} (keys: {', '.join(ONLY_KEYS)})")
    print(f"  GPU_CHECKS_ONLY: running {', '.join(k for k in ONLY_KEYS if k in keys)}")
    return keys


def attention_item(c: Checks, info: dict, key: str, only: set) -> None:
    """One attention item, its time cut so that the selected items after it keep theirs."""
    name, needs_cuda, limit = ATTENTION_ITEMS[key]
    keys = list(ATTENTION_ITEMS)
    later = sum(ATTENTION_ITEMS[k][2] for k in keys[keys.index(key) + 1:] if k in only
                and (info["cuda"] or not ATTENTION_ITEMS[k][1]))
    if only & {"nccl", "offload", "long", "throughput", "documents", "sharded"} and info["cuda"]:
        later += LATER_RESERVE
    if needs_cuda and not info["cuda"]:
        c.add(name, "skipped", "no CUDA device")
        return
    out_json = os.path.join(c.out_dir, f"attention_{key}.json")
    if os.path.exists(out_json):
        os.remove(out_json)
    budget = max(30.0, min(limit, c.left() - later) - 20)
    status, dt, text = c.run([PY, os.path.abspath(__file__), "--attention", key, "--json",
                              out_json, "--budget-s", f"{budget:.0f}"], budget + 40,
                             log=f"attention_{key}")
    rows = []
    if os.path.exists(out_json):
        with open(out_json) as fh:
            rows = json.load(fh)
    c.extra[f"attention_{key}"] = rows
    bad = [r for r in rows if str(r.get("status", "")).startswith("failed")]
    ok = [r for r in rows if r.get("status") == "ok"]
    if status == "ok" and bad:
        status = "failed"
    detail = f"{len(ok)} of {len(rows)} rows ok" if rows else _failure(text)
    if bad:
        detail += f"; {_row_label(bad[0])}: {bad[0]['status']}"
    summary = _attention_summary(key, rows)
    if summary:
        detail += f"; {summary}"
    c.add(name, {"ok": "ok", "failed": "FAILED"}.get(status, status), detail[:200], dt)
    print("\n".join(ln for ln in text.splitlines() if ln.startswith("  ")))


def _row_label(row: dict) -> str:
    return " ".join(str(row[k]) for k in ("op", "check", "attention", "seq", "documents", "cp")
                    if row.get(k) is not None)


def _attention_summary(key: str, rows: list) -> str:
    if key == "schemas":
        misfit = [r["op"] for r in rows if r.get("fits_block_kernels") is False]
        return f"block_kernels' calls do not fit {', '.join(misfit)}" if misfit else (
            "block_kernels' calls fit" if rows else "")
    if key == "kernels":
        by = {(r["seq"], r["documents"], r["attention"]): r for r in rows if r.get("ms")}
        parts = []
        for (seq, docs, path), r in sorted(by.items()):
            other = by.get((seq, docs, "sdpa")) or by.get((seq, docs, "flex"))
            if path == "blockwise" and other:
                parts.append(f"{seq // 1024}K{'d' if docs else ''} {r['ms']:.0f}/{other['ms']:.0f} ms")
        return ("blockwise/sdpa|flex " + ", ".join(parts)) if parts else ""
    if key == "rehearsal":
        peak = next((r for r in rows if r.get("peak_gib") is not None), None)
        return (f"1M cp{PEAK_CP} rank peak {peak['peak_gib']:.1f} GiB (planner ring buffers "
                f"{peak['planner_backward_gib']:.1f})") if peak else ""
    return ""


def attention_main(key: str, json_path: str | None, budget_s: float) -> int:
    """One attention item in this process (the project importable). Exit 1 on a failed row."""
    rows: list[dict] = []
    deadline = time.time() + budget_s

    def save():
        if json_path:
            with open(json_path + ".tmp", "w") as fh:
                json.dump(rows, fh, indent=1)
            os.replace(json_path + ".tmp", json_path)

    {"schemas": _item_schemas, "kernels": _item_kernels, "rehearsal": _item_rehearsal}[key](
        rows, save, deadline)
    save()
    return 1 if any(str(r.get("status", "")).startswith("failed") for r in rows) else 0


def _guard(rows: list, save, row: dict, fn, deadline: float | None = None, need_s: float = 10):
    """Run fn(row) (it fills the row); the row's status: ok, OOM, failed: ..., or no time."""
    import torch
    rows.append(row)
    if deadline is not None and time.time() > deadline - need_s:
        row["status"] = "no time"
    else:
        t0 = time.time()
        try:
            fn(row)
            row.setdefault("status", "ok")
        except torch.cuda.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as err:                       # noqa: BLE001 - the row says what
            row["status"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
        row["seconds"] = round(time.time() - t0, 1)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    shown = {k: v for k, v in row.items() if k != "schema"}
    print("  " + ", ".join(f"{k} {_fmt(v)}" for k, v in shown.items()), flush=True)
    save()
    return row


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _item_schemas(rows, save, deadline) -> None:
    import torch
    print(f"  torch {torch.__version__}")
    for op, (positional, keywords) in ATTENTION_OPS.items():
        def fill(row, op=op, positional=positional, keywords=keywords):
            schema = getattr(torch.ops.aten, op).default._schema
            row["schema"] = str(schema)
            print(f"  {row['schema']}")
            args = [a for a in schema.arguments if not a.kwarg_only]
            required = [a for a in args if not a.has_default_value()]
            names = {a.name for a in schema.arguments}
            row["fits_block_kernels"] = (len(required) <= positional <= len(args)
                                         and keywords <= names)
        _guard(rows, save, {"op": op}, fill)


def _documents(s: int, n: int, device, seed: int = 0):
    """[1, s] ids of n packed documents (random boundaries), or None for n = 0."""
    import torch
    if not n:
        return None
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randperm(s - 1, generator=gen)[:n - 1] + 1
    ids = torch.zeros(s, dtype=torch.int64)
    ids[starts] = 1
    return ids.cumsum(0)[None].to(device)


def _pairs(s: int, ids) -> int:
    """(query, key) pairs of causal attention over rows of documents (the work)."""
    if ids is None:
        return s * (s + 1) // 2
    import torch
    lengths = torch.unique_consecutive(ids[0].cpu(), return_counts=True)[1]
    return int((lengths * (lengths + 1) // 2).sum())


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(fn, tensors, dout, reps: int, device) -> dict:
    """First call (compiles included), then the median of reps forward and backward times, and
    the peak memory above the inputs during them (CUDA)."""
    import torch
    leaves = [t.detach().requires_grad_() for t in tensors]

    def once():
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        out = fn(*leaves)
        _sync(device)
        t1 = time.perf_counter()
        out.backward(dout)
        _sync(device)
        return t1 - t0, time.perf_counter() - t1

    first = once()
    for t in leaves:
        t.grad = None
    cuda = device.type == "cuda"
    if cuda:
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = sorted((once() for _ in range(reps)), key=sum)
    fwd, bwd = times[len(times) // 2]
    out = {"first_ms": round(1e3 * sum(first), 2), "fwd_ms": round(1e3 * fwd, 3),
           "bwd_ms": round(1e3 * bwd, 3), "ms": round(1e3 * (fwd + bwd), 3)}
    if cuda:
        out["peak_memory_gib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 3)
    return out


def _gpu_tag() -> str:
    import torch
    return torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else "cpu"


def _write_bench(name: str, bench: str, rows: list, title: str, columns, notes) -> None:
    """bench/results/<name>.json in docs/performance.md's schema (GPU runs only)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from performance_table import write_results
    flat = [{k: v for k, v in r.items() if v is None or isinstance(v, (str, int, float, bool))}
            for r in rows]
    path = write_results(name, bench, flat, title=title, columns=columns, notes=notes,
                         command="bash tests/gpu/run_gpu_checks.sh")
    print(f"  results: {os.path.relpath(path, ROOT)}")


def _sdpa_fn(h: int, g: int, mask, device):
    """SDPA over [b, s, n, d] tensors, kv heads repeated; on CUDA never the math kernel (an
    error instead of [b, h, s, s] scores)."""
    import torch.nn.functional as F

    def fn(q, k, v):
        kr, vr = (t.repeat_interleave(h // g, dim=2) for t in (k, v))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, kr, vr))
        ctx = _nullcontext()
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            ctx = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                               SDPBackend.CUDNN_ATTENTION])
        with ctx:
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask,
                                                 is_causal=mask is None)
        return out.transpose(1, 2)
    return fn


def _item_kernels(rows, save, deadline, *, device="cuda", sizes=KERNEL_SIZES, shape=KERNEL_SHAPE,
                  dtype=None, paths=("blockwise", "sdpa", "flex"), documents=DOCUMENTS, reps=3,
                  write=True) -> None:
    import torch
    from megatron_sp.attention.block_kernels import block_kernel
    from megatron_sp.attention.blockwise import blockwise_attention, blockwise_plan
    from megatron_sp.attention.documents import document_causal_mask
    device, dtype = torch.device(device), dtype or torch.bfloat16
    h, g, d = shape
    kernel = block_kernel(device, dtype, d)
    print(f"  block kernel for {dtype} d {d} on {device.type}: {kernel}")
    inputs = {}

    def tensors(s):
        if inputs.get("seq") != s:
            inputs.clear()
            gen = torch.Generator(device=device).manual_seed(s)
            inputs["qkv"] = [torch.randn(1, s, n, d, generator=gen, device=device, dtype=dtype)
                             for n in (h, g, g)]
            inputs["dout"] = torch.randn(1, s, h, d, generator=gen, device=device, dtype=dtype)
            inputs["seq"] = s
        return inputs["qkv"], inputs["dout"]

    def run(row, path, s, ids):
        (q, k, v), dout = tensors(s)
        row["pairs"] = _pairs(s, ids)
        if path == "blockwise":
            t0 = time.perf_counter()
            plan = blockwise_plan(ids, s, min(s, 512), True)     # once per step in training
            row["plan_ms"] = round(1e3 * (time.perf_counter() - t0), 2)
            row["kernel"] = kernel
            fn = lambda q, k, v: blockwise_attention(q, k, v, causal=True,   # noqa: E731
                                                     document_ids=ids, plan=plan)
        elif path == "sdpa":
            mask = None if ids is None else document_causal_mask(ids)      # [1, 1, s, s]
            fn = _sdpa_fn(h, g, mask, device)
            row["kernel"] = "sdpa " + ("s x s mask" if ids is not None else "causal")
        else:
            from megatron_sp.attention.flex import FlexAttention
            backend = FlexAttention()
            fn = lambda q, k, v: backend(q, k, v, document_ids=ids)         # noqa: E731
            row["kernel"] = "flex (compiled)"
        row.update(_fwd_bwd(fn, (q, k, v), dout, reps, device))
        flops = 4 * d * h * row["pairs"]
        row["fwd_tflops"] = round(flops / (row["fwd_ms"] * 1e-3) / 1e12, 1)
        row["tflops"] = round(3.5 * flops / (row["ms"] * 1e-3) / 1e12, 1)

    # flex last: it compiles for every shape and mask
    order = [p for p in paths if p != "flex"], [p for p in paths if p == "flex"]
    for group in filter(None, order):
        for s in sizes:
            for n_docs in (0, min(documents, s // 8)):
                ids = _documents(s, n_docs, device)
                for path in group:
                    row = {"seq": s, "documents": n_docs, "attention": path,
                           "dtype": str(dtype).replace("torch.", ""), "heads": h,
                           "kv_heads": g, "head_dim": d}
                    skip = None
                    if path == "sdpa" and n_docs and s > SDPA_MASK_MAX:
                        skip = f"an s x s mask past {SDPA_MASK_MAX}"
                    elif path == "flex" and device.type != "cuda":
                        skip = "flex has no CPU backward"
                    if skip:
                        rows.append(dict(row, status=f"skipped: {skip}"))
                        print(f"  {_row_label(row)}: skipped ({skip})")
                        continue
                    need = (60 if s >= 131072 else 15) + (45 if path == "flex" else 0)
                    _guard(rows, save, row, lambda row, path=path, s=s, ids=ids:
                           run(row, path, s, ids), deadline, need)
    inputs.clear()
    if write and device.type == "cuda":
        _write_bench(f"gpu_block_kernels_{_gpu_tag()}", "gpu_block_kernels", rows,
                     "Block kernels (blockwise_attention) vs SDPA and FlexAttention, forward + "
                     "backward, bf16, b 1, h 32, g 8, d 128",
                     [["seq", "seq"], ["documents", "documents"], ["attention", "attention"],
                      ["kernel", "kernel"], ["fwd_ms", "fwd ms"], ["bwd_ms", "bwd ms"],
                      ["ms", "fwd+bwd ms"], ["tflops", "TFLOP/s"], ["first_ms", "first call ms"],
                      ["peak_memory_gib", "peak GiB"], ["status", "status"]],
                     ["causal; documents: random boundaries; TFLOP/s counts 4 d h per computed "
                      "(query, key) pair forward and 3.5x that forward + backward",
                      "sdpa: kv heads repeated, flash / efficient / cuDNN only (no math "
                      "fallback); with documents the s x s bool mask, not past 32K",
                      "first call: compiles included (flex); ms: median of 3"])


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _per_document_reference(q, k, v, ids, dout):
    """Full causal attention under the block-diagonal document mask, in fp32, by SDPA per
    document (documents are independent under that mask) or over the row without documents;
    kv heads repeated. (out, dq, dk, dv) fp32, by autograd."""
    import torch
    import torch.nn.functional as F
    h, g = q.shape[2], k.shape[2]
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    qf, kf, vf = leaves
    kf, vf = (t.repeat_interleave(h // g, dim=2) for t in (kf, vf))
    if ids is None:
        bounds = [0, q.shape[1]]
    else:
        lengths = torch.unique_consecutive(ids[0].cpu(), return_counts=True)[1]
        bounds = [0] + torch.cumsum(lengths, 0).tolist()
    pieces = []
    ctx = _nullcontext()
    if q.is_cuda:                       # the efficient kernel or an error, never an s x s math
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])
    with ctx:
        for a, b in zip(bounds, bounds[1:]):
            qt, kt, vt = (t[:, a:b].transpose(1, 2) for t in (qf, kf, vf))
            pieces.append(F.scaled_dot_product_attention(qt, kt, vt,
                                                         is_causal=True).transpose(1, 2))
        out = torch.cat(pieces, dim=1)
        out.backward(dout.float())
    return out.detach(), [t.grad for t in leaves]


def _item_rehearsal(rows, save, deadline, *, device="cuda", seq=REHEARSAL_SEQ, cps=REHEARSAL_CPS,
                    shape=KERNEL_SHAPE, dtype=None, documents=DOCUMENTS, peak_seq=PEAK_SEQ,
                    peak_cp=PEAK_CP, write=True) -> None:
    import types
    import torch
    from megatron_sp.context_parallel.rehearsal import rehearse_rank_peak, ring_rehearsal
    from megatron_sp.memory.planner import ring_buffer_bytes
    device, dtype = torch.device(device), dtype or torch.bfloat16
    h, g, d = shape
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False              # an fp32 reference
    cases = [(documents, cp) for cp in cps] + [(0, max(cps))]
    refs = {}
    for n_docs, cp in cases:
        row = {"check": "rehearsal vs fp32 reference", "seq": seq, "documents": n_docs, "cp": cp,
               "dtype": str(dtype).replace("torch.", ""), "heads": h, "kv_heads": g,
               "head_dim": d}

        def run(row, n_docs=n_docs, cp=cp):
            ids = _documents(seq, n_docs, device)
            gen = torch.Generator(device=device).manual_seed(1)
            q, k, v = (torch.randn(1, seq, n, d, generator=gen, device=device, dtype=dtype)
                       for n in (h, g, g))
            dout = torch.randn(1, seq, h, d, generator=gen, device=device, dtype=dtype)
            if n_docs not in refs:
                refs.clear()
                refs[n_docs] = _per_document_reference(q, k, v, ids, dout)
            want, want_grads = refs[n_docs]
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            _sync(device)
            t0 = time.perf_counter()
            out = ring_rehearsal(*leaves, cp, document_ids=ids)
            out.backward(dout)
            _sync(device)
            row["ms"] = round(1e3 * (time.perf_counter() - t0), 1)
            row["out_max_abs_err"] = round((out.float() - want).abs().max().item(), 5)
            rel = [((t.grad.float() - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
                   for t, w in zip(leaves, want_grads)]
            row["dq_rel_err"], row["dk_rel_err"], row["dv_rel_err"] = (round(x, 5) for x in rel)
            row["tolerance"] = f"out {OUT_TOL} abs, grads {GRAD_REL_TOL} of max"
            if not (row["out_max_abs_err"] <= OUT_TOL and max(rel) <= GRAD_REL_TOL):
                row["status"] = "failed: beyond the bf16 tolerances"
        _guard(rows, save, row, run, deadline, 15)
    refs.clear()
    for n_docs in (0, documents):
        row = {"check": "one rank's peak memory", "seq": peak_seq, "documents": n_docs,
               "cp": peak_cp, "rank": 0, "dtype": str(dtype).replace("torch.", ""), "heads": h,
               "kv_heads": g, "head_dim": d}

        def peak(row, n_docs=n_docs):
            ids = _documents(peak_seq, n_docs, "cpu")
            t0 = time.perf_counter()
            got = rehearse_rank_peak(1, peak_seq, h, g, d, peak_cp, 0, dtype, device,
                                     document_ids=ids)
            row["ms"] = round(1e3 * (time.perf_counter() - t0), 1)
            planner = ring_buffer_bytes(types.SimpleNamespace(num_query_groups=g, kv_channels=d),
                                        peak_seq / peak_cp, cp=peak_cp,
                                        dtype_bytes=torch.finfo(dtype).bits // 8)
            row["planner_forward_gib"] = round(planner["forward"] / 2**30, 3)
            row["planner_backward_gib"] = round(planner["backward"] / 2**30, 3)
            n = peak_seq // peak_cp
            e = torch.finfo(dtype).bits // 8
            row["rank_q_kv_gib"] = round(n * (h + 2 * g) * d * e / 2**30, 3)
            if got is None:
                row["status"] = "skipped: no CUDA peak"
            else:
                row["peak_gib"] = round(got / 2**30, 3)
        _guard(rows, save, row, peak, deadline, 45)
    torch.backends.cuda.matmul.allow_tf32 = old_tf32
    if write and device.type == "cuda":
        _write_bench(f"gpu_ring_rehearsal_{_gpu_tag()}", "gpu_ring_rehearsal", rows,
                     "Ring rehearsal (context_parallel/rehearsal.py): cp virtual ranks in one "
                     "process vs fp32 attention, and one rank's peak memory at 1M tokens",
                     [["check", "check"], ["seq", "seq"], ["documents", "documents"],
                      ["cp", "cp"], ["out_max_abs_err", "out err"], ["dq_rel_err", "dq rel"],
                      ["dk_rel_err", "dk rel"], ["dv_rel_err", "dv rel"], ["ms", "ms"],
                      ["peak_gib", "rank peak GiB"], ["planner_backward_gib",
                                                      "planner ring bwd GiB"],
                      ["rank_q_kv_gib", "rank q, k, v GiB"], ["status", "status"]],
                     ["bf16, h 32, g 8, d 128; reference: SDPA per document in fp32 (TF32 off)",
                      f"tolerances: out max abs error {OUT_TOL}, dq / dk / dv max error "
                      f"{GRAD_REL_TOL} of the reference's max",
                      "rank peak: max_memory_allocated above the rank's own q, k, v during its "
                      "forward + backward, the other ranks' blocks random, one at a time; "
                      "planner: memory/planner.ring_buffer_bytes (buffers in flight only)"])


def pretrain_results(c: Checks, info: dict) -> None:
    """The pretrain_gpt.py rows (NCCL smoke, sharded modes) as bench/results/gpu_pretrain_<gpu>.json
    in docs/performance.md's schema (written here without importing the project)."""
    rows = [r for r in c.extra.get("sharded", []) if r.get("status") == "ok"]
    if not info or not info.get("cuda") or not rows:
        return
    name = info.get("device", "gpu").split(",")[0]
    record = {"schema": 1, "bench": "gpu_pretrain", "title": "pretrain_gpt.py, llama-1b at 8K, "
              "world of 1 over NCCL: unsharded and sharded model state",
              "device": {"kind": "gpu", "name": name, "peak_tflops": None,
                         "peak_note": "MFU from the training log line (flops.PEAK_TFLOPS)"},
              "torch": info["versions"].get("torch"), "command": "bash tests/gpu/run_gpu_checks.sh",
              "date": time.strftime("%Y-%m-%d"),
              "columns": [["model", "model"], ["seq", "seq"], ["layout", "layout"],
                          ["lm_loss", "lm loss"], ["ms_per_iter", "ms/iter"],
                          ["tokens_per_s", "tokens/s"], ["mfu", "MFU"],
                          ["peak_memory_gib", "peak GiB"]],
              "rows": [{"model": "llama-1b", "seq": 8192, "layout": r["mode"],
                        "lm_loss": r["lm_loss"], "ms_per_iter": r["ms_per_iter"],
                        "tokens_per_s": 8192 / (r["ms_per_iter"] / 1e3) if r["ms_per_iter"] else None,
                        "mfu": r["mfu"], "peak_memory_gib": r["mem_peak_gb"]} for r in rows],
              "notes": ["bf16, micro-batch 1, 6 iterations, the last logged record"]}
    gpu = name.split()[-1].lower() if name else "gpu"
    path = os.path.join(ROOT, "bench", "results", f"gpu_pretrain_{gpu}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh, indent=1)
    os.replace(path + ".tmp", path)


def copy_results(c: Checks) -> None:
    """bench/results/*.json written during this run, copied to $OUT/results (what comes back)."""
    folder = os.path.join(ROOT, "bench", "results")
    fresh = [f for f in os.listdir(folder) if f.endswith(".json")
             and os.path.getmtime(os.path.join(folder, f)) >= c.start] if os.path.isdir(folder) else []
    if fresh:
        os.makedirs(os.path.join(c.out_dir, "results"), exist_ok=True)
        for f in fresh:
            with open(os.path.join(folder, f)) as src, \
                    open(os.path.join(c.out_dir, "results", f), "w") as dst:
                dst.write(src.read())
        print(f"results: {', '.join(sorted(fresh))} -> {c.out_dir}/results (regenerate "
              f"docs/performance.md: python bench/performance_table.py)")


def table(c: Checks) -> str:
    rows = [f"{'item':<36} {'status':<14} {'s':>6}  detail"]
    for it in c.items:
        rows.append(f"{it['item'][:36]:<36} {it['status']:<14} {it['seconds']:>6.0f}  {it['detail'][:60]}")
    for r in c.extra.get("sharded", []):
        if r.get("lm_loss") is not None:
            rows.append(f"  sharded row: {r['mode']:<32} loss {r['lm_loss']:.4f}  "
                        f"{r['ms_per_iter'] or 0:.0f} ms/iter  peak {r['mem_peak_gb'] or 0:.1f} GB")
    return "\n".join(rows)


def install_fallback() -> int:
    """Make megatron_sp, megatron_sp.models (models/) and megatron_sp.data (data/) importable
    without pip and without PYTHONPATH: a meta-path finder module + a .pth file that imports it, in
    the interpreter's site-packages when writable, else in the user site. Returns 0 when a fresh
    interpreter then imports all three."""
    import site
    import sysconfig
    finder = f'''"""megatron_sp from the checkout {ROOT} (written by tests/gpu/gpu_checks.py)."""
import importlib.util, os, sys
_MAP = {{"megatron_sp": {os.path.join(ROOT, "megatron_sp")!r},
        "megatron_sp.models": {os.path.join(ROOT, "models")!r},
        "megatron_sp.data": {os.path.join(ROOT, "data")!r}}}


class _Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in _MAP:
            return None
        return importlib.util.spec_from_file_location(
            name, os.path.join(_MAP[name], "__init__.py"), submodule_search_locations=[_MAP[name]])


if not any(getattr(f, "__name__", "") == "_Finder" for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder)
'''
    targets = [sysconfig.get_paths()["purelib"]]
    if site.ENABLE_USER_SITE:
        targets.append(site.getusersitepackages())
    for target in targets:
        try:
            os.makedirs(target, exist_ok=True)
            with open(os.path.join(target, "megatron_sp_checkout_finder.py"), "w") as fh:
                fh.write(finder)
            with open(os.path.join(target, "megatron_sp_checkout.pth"), "w") as fh:
                fh.write("import megatron_sp_checkout_finder\n")
        except OSError as err:
            print(f"  cannot write to {target}: {err}")
            continue
        with tempfile.TemporaryDirectory() as cwd:
            ok = subprocess.run([PY, "-c", "import megatron_sp.models, megatron_sp.data"], cwd=cwd,
                                env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).returncode == 0
        if ok:
            print(f"  installed a finder for the checkout in {target}")
            return 0
    return 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--install-fallback", action="store_true", help="(used by run_gpu_checks.sh)")
    p.add_argument("--install", default="unknown", help="how the shell installed the project")
    p.add_argument("--install-seconds", type=float, default=0.0)
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_CHECKS_BUDGET_S", 720)))
    p.add_argument("--attention", choices=sorted(ATTENTION_ITEMS),
                   help="(used by the attention items) run one of them in this process")
    p.add_argument("--json", help="(with --attention) where its rows go")
    args = p.parse_args(argv)
    if args.install_fallback:
        return install_fallback()
    if args.attention:
        return attention_main(args.attention, args.json, args.budget_s)
    start = float(os.environ.get("GPU_CHECKS_START", time.time()))
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "runs", "gpu_checks")
    c = Checks(out_dir, args.budget_s - 15, start)
    c.extra["started"] = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(start))
    print(f"GPU checks: results in {out_dir}/gpu_checks.json; time box {args.budget_s:.0f} s "
          f"({c.left():.0f} s left)", flush=True)
    c.add("install (offline)", "ok" if args.install in ("pip-editable", "fallback") else "FAILED",
          {"pip-editable": "pip install --no-deps --no-build-isolation -e .",
           "fallback": "pip could not build it: a meta-path finder for the checkout (.pth)"}.get(
              args.install, args.install), args.install_seconds)
    info = probe(c)
    if info is not None:
        only = _selected()
        results = cuda_tests(c, info) if "cuda" in only else {}
        if "cuda" in only:
            fused_backends(c, info, results)
        for key in ATTENTION_ITEMS:
            if key in only:
                attention_item(c, info, key, only)
        if "nccl" in only:
            nccl_and_sharded(c, info, first=True)
        if "offload" in only:
            offload_head_chunks(c, info)
        if "long" in only:
            long_context(c, info)
        if "throughput" in only:
            throughput(c, info)
        if "documents" in only:
            documents_longest(c, info)
        if "moe" in only:
            moe_layer(c, info)
        if "sharded" in only:
            nccl_and_sharded(c, info, first=False)
        if "fp8" in only:
            fp8_rows(c, info)
        pretrain_results(c, info)
    copy_results(c)
    c.extra["seconds"] = round(time.time() - start, 1)
    c.save()
    print("\n" + table(c))
    bad = [it["item"] for it in c.items if it["status"] in ("FAILED", "timeout")]
    print(f"\n{len(c.items)} items, {len(bad)} failed or timed out"
          + (f": {', '.join(bad)}" if bad else "") + f"; {c.extra['seconds']:.0f} s; "
          f"{os.path.join(out_dir, 'gpu_checks.json')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
