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
  nccl smoke     pretrain_gpt.py as a world of one over NCCL (torch.distributed.run): llama-1b at
                 8K, bf16, 6 iterations; its loss, ms/iter, MFU and peak memory are the unsharded row
  long context   bench/gpu_long_context.py: MFU of llama-1b at 8K and 32K, the longest trainable
                 sequence per memory technique, the planner's prediction beside each measured peak
  throughput     bench/gpu_throughput.py: llama-1b and a Llama-3-8B-shaped model (as many layers as
                 fit) at 8K and 32K: eager vs compiled, SDPA vs flex (with and without documents),
                 ours vs Hugging Face LlamaForCausalLM on the same weights; MFU per row
  documents      bench/gpu_long_context.py --attention flex --documents: the longest llama-1b
                 sequence with packed documents through FlexAttention, beside the planner
  sharded        the same run with --use-torch-fsdp2, --use-distributed-optimizer, and each with
                 --optimizer-cpu-offload ("not available" when pretrain_gpt.py lacks the flag)

Subprocesses run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless it is set (long
sequences: fewer unusable split blocks). Without CUDA every GPU item is skipped with one line, and
the run exits 0 (the CPU rehearsal, tests/gpu/test_rehearsal.py). A failed or timed-out item
makes the exit status 1. Results: $OUT/gpu_checks.json (rewritten after every item; OUT defaults to runs/gpu_checks) and a table;
the benches also write their rows under bench/results/ (docs/performance.md's schema: regenerate the
page with `python bench/performance_table.py` and commit both).
This file imports nothing from the project: it must start before the project is importable.
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
            "apex"]
SHARDED = [("fsdp2", ["--use-torch-fsdp2"]),
           ("distributed optimizer", ["--use-distributed-optimizer"]),
           ("fsdp2 + optimizer cpu offload", ["--use-torch-fsdp2", "--optimizer-cpu-offload"]),
           ("distopt + optimizer cpu offload", ["--use-distributed-optimizer",
                                                "--optimizer-cpu-offload"])]
RUN_ARGS = ["--model", "llama-1b", "--mock-data", "--seq-length", "8192", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "6", "--log-interval", "3",
            "--eval-iters", "0", "--bf16", "--lr", "1e-4", "--lr-warmup-iters", "0",
            "--lr-decay-iters", "6", "--attention-backend", "sdpa", "--distributed-backend", "nccl"]

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
    flags = sorted({f for _, fl in SHARDED for f in fl})
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


def _bench_table(text: str) -> str:
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip().startswith("technique")), None)
    return "\n".join(lines[start:]) if start is not None else ""


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
    args = p.parse_args(argv)
    if args.install_fallback:
        return install_fallback()
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
        results = cuda_tests(c, info)
        fused_backends(c, info, results)
        nccl_and_sharded(c, info, first=True)
        long_context(c, info)
        throughput(c, info)
        documents_longest(c, info)
        nccl_and_sharded(c, info, first=False)
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
