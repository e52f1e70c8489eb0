#!/usr/bin/env python
"""Run pretrain_gpt.py with every training step's CPU time recorded per rank (for benches).

    python bench/step_cpu_time.py OUT_PREFIX pretrain_gpt.py ARGS...   # under torchrun

Each rank appends one JSON line per Trainer.train_step to OUT_PREFIX.rank<RANK>.jsonl:
{"wall_s", "thread_cpu_s", "process_cpu_s"}: the step's elapsed time, the CPU time of the
rank's main thread (time.thread_time: what the rank computed, not the time it waited for its
peer nor the time other jobs on a shared machine held the core) and of the whole process (gloo's
threads included). One thread per rank (OMP_NUM_THREADS=1) makes the main thread's figure the
rank's compute. Written after every step, so a run that exits through run_main's exit_process
still leaves them.
"""
import json
import os
import runpy
import sys
import time


def main():
    out, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    from megatron_sp.training import trainer
    inner = trainer.Trainer.train_step
    path = f"{out}.rank{os.environ.get('RANK', '0')}.jsonl"

    def timed_step(self, *a, **k):
        wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
        try:
            return inner(self, *a, **k)
        finally:
            with open(path, "a") as f:
                f.write(json.dumps({"wall_s": time.perf_counter() - wall,
                                    "thread_cpu_s": time.thread_time() - thread,
                                    "process_cpu_s": time.process_time() - process}) + "\n")

    trainer.Trainer.train_step = timed_step
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
