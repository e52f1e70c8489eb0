"""CPU rehearsal of the one GPU script: it must work the first time on a bare machine.

Runs in the normal suite, on CPU (no GPU needed, not skipped). It copies the checkout's tracked files
(a clean checkout), builds a plain virtual environment that sees only torch, numpy, pytest,
sentencepiece and tqdm (and what they need to import: a folder of links to exactly those
distributions, named in a .pth file; nothing is downloaded), puts only `python3` on PATH (no
`python`), and runs `bash tests/gpu/run_gpu_checks.sh` with PIP_NO_INDEX=1. Expected: the project
installs offline, every CUDA item is skipped with one line, the attention schemas item (no GPU
needed) runs in its subprocess and finds block_kernels' calls fitting this torch's aten schemas,
the JSON is written, the exit status is 0. About 30-60 s (most of it creating the venv and
importing torch in a few processes).

The attention items' bodies (gpu_checks.py --attention kernels / rehearsal) are also run here in
process at toy sizes on CPU (their GPU sizes need the H200): rows made, guarded, summarised.
"""
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WANTED = ["torch", "numpy", "pytest", "sentencepiece", "tqdm"]
GPU_ITEMS = ["cuda tests", "block kernels vs sdpa/flex (bf16)", "ring rehearsal (32K docs, 1M peak)",
             "nccl smoke (llama-1b 8K, world of 1)", "long context (MFU, longest seq)",
             "throughput (compile, flex, vs HF)", "longest with documents (flex)"]


def _closure(names):
    """The distributions `names` need to import: their requirements without extras, recursively
    (markers evaluated for this interpreter)."""
    from packaging.requirements import Requirement
    seen, todo = {}, list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue                          # an optional requirement this machine lacks
        seen[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _expose(dists, folder):
    """Link each distribution's top-level modules and its metadata folder into `folder`."""
    os.makedirs(folder)
    for dist in dists:
        tops = set()
        for f in dist.files or []:
            parts = f.parts
            if parts[0] == ".." or parts[0] == "__pycache__":
                continue
            tops.add(parts[0])
        for top in tops:
            src = os.path.join(str(dist.locate_file("")), top)
            dst = os.path.join(folder, top)
            if os.path.exists(src) and not os.path.exists(dst):
                os.symlink(src, dst)


def _path_without_python(folder, python3):
    """A bin folder: python3 (a wrapper that execs the venv's, so that the venv is the one found:
    a bare link would be resolved to the base interpreter) and links to the system tools, but no
    python*/pip*."""
    os.makedirs(folder)
    wrapper = os.path.join(folder, "python3")
    with open(wrapper, "w") as fh:
        fh.write(f'#!/bin/sh\nexec "{python3}" "$@"\n')
    os.chmod(wrapper, 0o755)
    for sysdir in ("/usr/local/bin", "/usr/bin", "/bin"):
        if not os.path.isdir(sysdir):
            continue
        for name in os.listdir(sysdir):
            if name.startswith(("python", "pip", "torchrun", "pytest")):
                continue
            dst = os.path.join(folder, name)
            if not os.path.lexists(dst):
                os.symlink(os.path.join(sysdir, name), dst)
    return folder


def _clean_checkout(dst):
    # tracked files and the new ones git would track (not ignored): the checkout as it will be committed
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True, text=True).stdout.split("\0")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):
            continue                              # deleted in the working tree
        os.makedirs(os.path.join(dst, os.path.dirname(rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, rel))
    # uncommitted new files of this folder too (the script under test may not be committed yet)
    for name in os.listdir(os.path.join(ROOT, "tests", "gpu")):
        if name.endswith((".py", ".sh")):
            shutil.copy2(os.path.join(ROOT, "tests", "gpu", name), os.path.join(dst, "tests", "gpu", name))


@pytest.mark.timeout(600)
def test_gpu_script_rehearsal_on_a_bare_cpu_machine(tmp_path):
    repo, home, out = tmp_path / "repo", tmp_path / "home", tmp_path / "out"
    _clean_checkout(str(repo))
    home.mkdir()
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, symlinks=True).create(env_dir)
    python3 = str(env_dir / "bin" / "python3")
    site = subprocess.run([python3, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    _expose(_closure(WANTED), str(tmp_path / "visible"))
    with open(os.path.join(site, "rehearsal_packages.pth"), "w") as fh:
        fh.write(str(tmp_path / "visible") + "\n")
    bindir = _path_without_python(str(tmp_path / "bin"), python3)
    assert shutil.which("python", path=bindir) is None and shutil.which("python3", path=bindir)
    # the script's python3 is the rehearsal venv (its pip install must never reach a shared site)
    prefix = subprocess.run(["python3", "-c", "import sys; print(sys.prefix)"], env={"PATH": bindir},
                            capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.realpath(prefix) == os.path.realpath(env_dir), prefix
    env = {"PATH": bindir, "HOME": str(home), "PIP_NO_INDEX": "1", "OUT": str(out),
           "LANG": "C.UTF-8", "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", "tests/gpu/run_gpu_checks.sh"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=540)
    text = proc.stdout + proc.stderr
    print(text)                                    # the rehearsal's output, for the report
    assert proc.returncode == 0, text
    assert re.search(r"install: (pip-editable|fallback)", text), text
    report = json.loads((out / "gpu_checks.json").read_text())
    status = {it["item"]: it["status"] for it in report["items"]}
    assert status["install (offline)"] == "ok" and status["probe (versions, import)"] == "ok"
    assert report["environment"]["megatron_sp"].startswith(str(repo))   # the copy, installed
    assert report["environment"]["cuda"] is False
    seen = {k for k, v in report["environment"]["versions"].items() if v}
    assert seen <= set(WANTED) | {"setuptools"}, seen     # nothing else of this machine leaks in
    for item in GPU_ITEMS:                         # each skipped, with one line
        assert status[item] == "skipped", (item, status)
        assert len([ln for ln in proc.stdout.splitlines() if f"] {item}" in ln]) == 1
    for item in ("transformer engine", "flash-attn"):
        assert status[item] == "not installed"
    for item in ("fsdp2", "distributed optimizer", "fsdp2 + optimizer cpu offload",
                 "distopt + optimizer cpu offload"):
        assert status[item] in ("skipped", "not available"), (item, status)
    assert status["aten attention schemas"] == "ok", status
    schemas = report["attention_schemas"]
    assert len(schemas) == 4 and all(r["fits_block_kernels"] for r in schemas), schemas
    assert all(r["schema"].startswith("aten::_") for r in schemas)
    assert "cuda tests" in text and "items, 0 failed" in text


def test_attention_items_at_toy_sizes_on_cpu():
    """The kernels and rehearsal items' code, in process on CPU: rows ok or skipped with the
    reason, none failed; a failing measurement is its row's status, not the item's end."""
    import sys
    import time

    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    import gpu_checks as gc
    rows = []
    saved = []
    deadline = time.time() + 120
    gc._item_kernels(rows, lambda: saved.append(len(rows)), deadline, device="cpu", sizes=(64,),
                     shape=(4, 2, 16), reps=1, documents=6)
    gc._item_rehearsal(rows, lambda: saved.append(len(rows)), deadline, device="cpu", seq=64,
                       cps=(2, 4), shape=(4, 2, 16), documents=5, peak_seq=64, peak_cp=4)
    status = [r["status"] for r in rows]
    assert not [s for s in status if s.startswith("failed")], rows
    kernels = [r for r in rows if r.get("attention")]
    assert {(r["attention"], r["documents"]) for r in kernels if r["status"] == "ok"} == {
        ("blockwise", 0), ("blockwise", 6), ("sdpa", 0), ("sdpa", 6)}
    assert all(r["status"] == "skipped: flex has no CPU backward" for r in kernels
               if r["attention"] == "flex")
    checks = [r for r in rows if r.get("check") == "rehearsal vs fp32 reference"]
    assert [(r["cp"], r["documents"], r["status"]) for r in checks] == [
        (2, 5, "ok"), (4, 5, "ok"), (4, 0, "ok")]
    assert all(r["out_max_abs_err"] <= gc.OUT_TOL for r in checks)
    peaks = [r for r in rows if r.get("check") == "one rank's peak memory"]
    assert [r["status"] for r in peaks] == ["skipped: no CUDA peak"] * 2
    assert saved, "rows were never saved"
    assert "blockwise/sdpa|flex" in gc._attention_summary("kernels", kernels)
    # one guarded failure is that row's status
    bad = gc._guard([], lambda: None, {"check": "x"}, lambda row: torch.zeros(2) @ torch.zeros(3))
    assert bad["status"].startswith("failed: RuntimeError")
