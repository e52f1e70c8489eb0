#!/usr/bin/env python
"""What checkpoint integrity costs: digest speeds, verification GB/s per rank and its share of the
load time, and who should checksum at save.

1. Digests on one thread, one 256 MiB buffer, in CPU time (steady on a shared machine) and wall
   time: xxhash's XXH3-64 / XXH64 (when installed) and those of the standard library (zlib,
   hashlib): the reason for XXH3, with CRC-32 as the fallback
   (megatron_sp/checkpointing/integrity.py).
2. Load: W gloo ranks on CPU, each holding a `--mib` MiB shard (weights and AdamW moments) of
   transformer layers split over tensor parallelism (hidden 1024; one DCP file per rank). Per rank, median of `--repeats`: load_checkpoint without and with
   verification, and the verification alone (verify_files on the files this rank's plan opens).
       verify GB/s per rank   = bytes the rank verifies (the segments its plan reads)
                                / verification time
       share of load time     = verification time / load time with verification   (target < 10%)
       added to the load      = (load time with - without verification) / load time without
                                (the difference of two noisy medians; on a cold page cache it is
                                the honest cost, as the verification's read spares DCP its own)
   Twice: page cache warm (the files just written: the CRC's CPU cost against DCP's own reading
   and decoding) and cold (each file dropped from the page cache first with posix_fadvise
   DONTNEED, as after a restart on another node: the verification's read then does the I/O and
   DCP reads from the page cache, so the added time is about the digest's CPU time alone).
   Once per digest (`--digests`, default xxh3 and crc32): the save records that digest.
3. Save: checksumming each rank's own files (the slowest rank's time; what save does) against rank
   0 checksumming every file after the barrier.

    python bench/checkpoint_io.py                           # W = 1, 2; 256 MiB per rank (~1 min)
    python bench/checkpoint_io.py --world 1 2 4 --mib 512 --threads 1 2
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import statistics
import sys
import tempfile
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sp import checkpointing as ck  # noqa: E402
from megatron_sp.checkpointing import integrity  # noqa: E402
from megatron_sp.testing import run_distributed  # noqa: E402

_DIGESTS = {
    "xxh3 (xxhash, XXH3-64)": lambda b: __import__("xxhash").xxh3_64_intdigest(b),
    "xxh64 (xxhash)": lambda b: __import__("xxhash").xxh64_intdigest(b),
    "crc32 (zlib)": zlib.crc32,
    "adler32 (zlib)": zlib.adler32,
    "md5": lambda b: hashlib.md5(b).digest(),
    "sha1": lambda b: hashlib.sha1(b).digest(),
    "sha256": lambda b: hashlib.sha256(b).digest(),
    "blake2b": lambda b: hashlib.blake2b(b).digest(),
}


def digest_table(repeats: int) -> list[str]:
    buf = os.urandom(256 << 20)
    rows = ["| digest | GB/s, one thread (CPU time) | GB/s (wall) |", "|---|---|---|"]
    for name, fn in _DIGESTS.items():
        if name.startswith("xx") and integrity._digest_function("xxh3") is None:
            continue   # xxhash not installed
        wall, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            fn(buf)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        rows.append(f"| {name} | {len(buf) / statistics.median(cpu) / 1e9:.2f} | "
                    f"{len(buf) / statistics.median(wall) / 1e9:.2f} |")
    return rows


def _shard_params(mesh, mib: int, seed: int):
    """About `mib` MiB of fp32 transformer-layer parameters (hidden 1024: qkv, proj, fc1, fc2,
    norms and biases), split over tp on dim 0 so that each rank writes its own rows (one file)."""
    g = torch.Generator().manual_seed(seed + mesh.rank)
    h, tp = 1024, mesh.tp_size
    layer = [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h), (3 * h,), (h,), (4 * h,), (h,), (h,), (h,)]
    per_layer = sum(torch.Size(s).numel() for s in layer) * 4 // tp
    params = []
    for _ in range(max(1, round((mib << 20) / per_layer))):
        for shape in layer:
            p = torch.nn.Parameter(torch.randn((shape[0] // tp,) + shape[1:], generator=g))
            p.tp_partition_dim = 0
            params.append(p)
    return torch.nn.ParameterList(params)


def _planned_ranges(load) -> dict[str, list[tuple[int, int]] | None]:
    """{file: [(offset, length)]} that the load planner verifies during `load()` (recorded)."""
    from megatron_sp.checkpointing import planners
    seen = {".metadata": None}
    real = planners.verify_files

    def record(folder, files, *args, **kwargs):
        seen.update(files)
        return real(folder, files, *args, **kwargs)

    planners.verify_files = record
    try:
        load()
    finally:
        planners.verify_files = real
    return seen


def _verified_bytes(ranges, records) -> int:
    """Bytes of the segments `verify_files` reads for these ranges."""
    total = 0
    for name, r in ranges.items():
        ends = records[name]["ends"]
        total += sum(ends[k] - (ends[k - 1] if k else 0) for k in integrity._segments_of(ends, r))
    return total


def _load_worker(rank, world, root, mib, repeats, threads, digest):
    import torch.distributed as dist
    from megatron_sp.mesh import ParallelMesh
    torch.set_num_threads(threads)
    integrity.algorithm = lambda: digest   # what the save records (verification follows it)
    mesh = ParallelMesh.from_sizes(tp=world)
    model = _shard_params(mesh, mib // 3, seed=1)   # weights + AdamW's two moments = mib
    opt = torch.optim.AdamW(model.parameters())
    ck.optimizer_state([model], opt, mesh.tp_rank, mesh.tp_size, create=True)
    ck.save_checkpoint(root, 1, [model], mesh, optimizer=opt)
    folder = os.path.join(root, "iter_0000001")
    meta = ck.read_meta(folder)
    assert meta["checksums"]["algorithm"] == digest, meta["checksums"]["algorithm"]
    records = meta["checksums"]["files"]
    mine = _planned_ranges(lambda: ck.load_checkpoint(root, [model], mesh, optimizer=opt))
    nbytes = _verified_bytes(mine, records)
    out = {"bytes": nbytes}
    for cache in ("warm", "cold"):
        plain, checked, verify = [], [], []
        for _ in range(repeats):
            plain.append(_timed(lambda: ck.load_checkpoint(root, [model], mesh, optimizer=opt,
                                                           verify=False), folder, cache))
            checked.append(_timed(lambda: ck.load_checkpoint(root, [model], mesh, optimizer=opt,
                                                             verify=True), folder, cache))
            verify.append(_timed(lambda: integrity.verify_files(folder, mine, records, "",
                                                                threads=threads), folder, cache))
        out[cache] = {k: [statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)]
                      for k, v in (("plain", plain), ("checked", checked), ("verify", verify))}
    # Save side: each rank its own files vs rank 0 all of them.
    names = [n for n in sorted(os.listdir(folder)) if n != ck.META_FILENAME]
    own, zero = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        integrity.checksum_files(folder, integrity.files_of_rank(folder, rank, world,
                                                                 skip={ck.META_FILENAME}), threads)
        own.append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            integrity.checksum_files(folder, names, threads)
            zero.append(time.perf_counter() - t0)
        dist.barrier()
    out["own"] = statistics.median(own)
    out["zero"] = statistics.median(zero) if zero else None
    return out


def _evict(folder):
    """Drop the folder's files from the page cache (posix_fadvise DONTNEED: these files only)."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn, folder, cache) -> tuple[float, float]:
    """(wall, CPU) seconds of `fn` on every rank at once (barrier first), the files evicted first
    if cold. CPU time (this process, all threads) is what verification costs on a busy machine."""
    import torch.distributed as dist
    if cache == "cold":
        _evict(folder)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _quiet_worker(rank, world, *args):
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        return _load_worker(rank, world, *args)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2])
    p.add_argument("--mib", type=int, default=256, help="MiB of parameters per rank")
    p.add_argument("--threads", type=int, nargs="+", default=[1],
                   help="verification threads per rank (torch.set_num_threads)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--digests", nargs="+", default=["xxh3", "crc32"], choices=["xxh3", "crc32"],
                   help="digests recorded at save and verified (xxh3 needs the xxhash package)")
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: $TMPDIR)")
    a = p.parse_args(argv)
    print("\n".join(digest_table(3)) + "\n")
    rows = ["| ranks | threads/rank | digest | MiB/rank | page cache | load: wall / CPU (s) | "
            "load + verify: wall / CPU (s) | verify: wall / CPU (s) | verify GB/s per rank (wall) | "
            "share of load: wall / CPU | added to the load: wall / CPU |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    save = ["| ranks | threads/rank | digest | MiB/rank | each rank its own files (s) | "
            "rank 0 all files (s) |", "|---|---|---|---|---|---|"]
    for world, threads, digest in itertools.product(a.world, a.threads, a.digests):
        with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
            out = run_distributed(_quiet_worker, world, os.path.join(tmp, "ck"), a.mib,
                                  a.repeats, threads, digest, timeout_s=1800,
                                  collective_timeout_s=600)
        for cache in ("warm", "cold"):
            r = [o[cache] for o in out]
            w = max(range(world), key=lambda i: r[i]["verify"][0])   # the slowest rank
            plain, checked, verify = r[w]["plain"], r[w]["checked"], r[w]["verify"]
            rows.append(f"| {world} | {threads} | {digest} | {out[w]['bytes'] / 2**20:.0f} | "
                        f"{cache} | "
                        f"{plain[0]:.3f} / {plain[1]:.3f} | {checked[0]:.3f} / {checked[1]:.3f} | "
                        f"{verify[0]:.3f} / {verify[1]:.3f} | {out[w]['bytes'] / verify[0] / 1e9:.2f} | "
                        f"{verify[0] / checked[0]:.1%} / {verify[1] / checked[1]:.1%} | "
                        f"{checked[0] / plain[0] - 1:+.1%} / {checked[1] / plain[1] - 1:+.1%} |")
            print(rows[-1], flush=True)
        save.append(f"| {world} | {threads} | {digest} | {out[0]['bytes'] / 2**20:.0f} | "
                    f"{max(o['own'] for o in out):.3f} | "
                    f"{out[0]['zero']:.3f} |")
    print("\n" + "\n".join(rows) + "\n\n" + "\n".join(save))


if __name__ == "__main__":
    main()
