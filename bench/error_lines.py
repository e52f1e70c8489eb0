"""How often a start-up mistake reaches the terminal exactly once under a launcher (issue 34).

    python bench/error_lines.py --runs 5 --nproc 4              # torchrun
    python bench/error_lines.py --runs 5 --nproc 4 --by-hand    # RANK/WORLD_SIZE set by hand

Each case launches pretrain_gpt.py `--runs` times with a mistake every rank finds and counts the
`error:` lines in the combined output; the table gives the runs with exactly one. Not a timed
test: the launcher's race depends on the load (the test suite forces it instead:
tests/distributed/test_error_once.py). `--root` measures another checkout (e.g. a worktree of an
older commit) with this script.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp.testing import free_port  # noqa: E402

TINY = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "1", "--eval-iters", "0"]
CASES = {
    "--cp-comm-type a2a+p2p without sizes": ["--context-parallel-size", "4", "--cp-comm-type",
                                             "a2a+p2p"],
    "--hierarchical-context-parallel-sizes 3 2": ["--context-parallel-size", "4", "--cp-comm-type",
                                                  "a2a+p2p", "--hierarchical-context-parallel-"
                                                  "sizes", "3", "2"],
    "a missing --data-path file": ["--data-path", "/nonexistent/corpus_text_document",
                                   "--tokenizer-type", "NullTokenizer"],
    "a sequence the layout cannot split": ["--context-parallel-size", "4", "--seq-length", "30"],
}
ERROR_LINE = re.compile(r"^(\[[^\]]*\]:?)?\s*error:", re.M)


def launch(root: str, nproc: int, args: list[str], by_hand: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if not by_hand:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), "pretrain_gpt.py", *args]
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        return done.stdout + done.stderr
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "pretrain_gpt.py", *args], cwd=root,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(nproc)]
    return "".join(p.communicate(timeout=600)[0] for p in procs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--by-hand", action="store_true")
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = p.parse_args()
    launcher = "by hand" if a.by_hand else "torchrun"
    print(f"| case ({a.nproc} ranks, {launcher}) | runs with exactly one error line | lines per run |")
    print("|---|---|---|")
    for name, extra in CASES.items():
        args = TINY + extra
        if "--data-path" in extra:
            args.remove("--mock-data")
        counts = [len(ERROR_LINE.findall(launch(a.root, a.nproc, args, a.by_hand)))
                  for _ in range(a.runs)]
        print(f"| {name} | {sum(c == 1 for c in counts)}/{a.runs} | {counts} |", flush=True)


if __name__ == "__main__":
    main()
