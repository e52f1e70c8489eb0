"""pretrain_gpt.py ends a user's mistake with one sentence, exit status 1, no traceback (docs/design.md §12);
`--debug` keeps the traceback; a finished run exits 0 whatever the interpreter's teardown does.

One rank, tiny models, --mock-data; the runs of a test start together (they are independent).
Every run goes through an entry wrapper that registers os.abort at exit: a process that left
through the interpreter's finalization would die with SIGABRT (-6), as a finished 2-rank run did
under load when a gloo thread took the GIL during finalization; pretrain_gpt leaves with
os._exit, so the status is the run's own (megatron_sp/errors.py).
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3"]
# Teardown that would fail the run: an abort at interpreter exit (never reached with os._exit).
ENTRY = ("import atexit, os, runpy, sys; atexit.register(os.abort); "
         "sys.argv = ['pretrain_gpt.py'] + sys.argv[1:]; "
         "runpy.run_path('pretrain_gpt.py', run_name='__main__')")


def start(args, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_SP_INJECT_")
               and k not in ("RANK", "WORLD_SIZE", "MEGATRON_SP_DEBUG")}
    environ.update(OMP_NUM_THREADS="1", **{k: str(v) for k, v in env.items()})
    return subprocess.Popen([sys.executable, "-c", ENTRY, *args], cwd=ROOT, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, limit_s=240):
    out, err = proc.communicate(timeout=limit_s)
    return proc.returncode, out, err


def assert_one_sentence(rc, out, err, expected_start):
    """Exit 1; the last stderr line is the one `error:` line of the run; no traceback."""
    assert rc == 1, (rc, out[-2000:], err[-3000:])
    lines = [line for line in (out + err).splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err[-3000:]
    assert lines[0].startswith(expected_start), lines[0]
    assert lines[0].endswith(".") and "\n" not in lines[0]
    assert "Traceback" not in out + err, err[-3000:]


def test_start_up_mistakes_are_one_sentence_and_a_finished_run_exits_0(tmp_path):
    bad = tmp_path / "bad"
    (tmp_path / "bad.idx").write_bytes(b"MMIDIDX")          # 7 bytes: a truncated index
    (tmp_path / "bad.bin").write_bytes(b"")
    data = [a for a in TINY if a != "--mock-data"] + ["--data-path", str(bad),
                                                      "--tokenizer-type", "NullTokenizer"]
    cases = {   # name: (flags, the sentence's start)
        "config": (TINY + ["--num-attention-heads", "5"],
                   "error: the model flags (--model and the flags that override it) do not fit: "
                   "hidden_size=64 is not divisible by num_attention_heads=5"),
        "mesh": (TINY + ["--tensor-model-parallel-size", "2"],
                 "error: world size 1 is not divisible by tp*sp*pp = 2 (tp=2, sp=1, pp=1): "
                 "choose sizes"),
        "batch size": (TINY + ["--global-batch-size", "3"],
                       "error: --global-batch-size 3 is not divisible by micro-batch size x dp = "
                       "2 x 1: choose a multiple of 2."),
        "data file": (data, f"error: {bad}.idx: truncated index (7 bytes, the header alone is 34); "
                            f"rebuild it"),
        "max skipped steps": (TINY + ["--max-skipped-steps", "0"],
                              "error: --max-skipped-steps must be at least 1, got 0."),
    }
    procs = {name: start(flags + ["--train-iters", "1"]) for name, (flags, _) in cases.items()}
    procs["debug"] = start(cases["config"][0] + ["--train-iters", "1", "--debug"])
    procs["finished"] = start(TINY + ["--train-iters", "2", "--save", str(tmp_path / "ck")])
    results = {name: finish(p) for name, p in procs.items()}
    for name, (_, expected) in cases.items():
        assert_one_sentence(*results[name], expected)
    rc, out, err = results["debug"]      # --debug: the traceback, then the same sentence
    assert rc == 1 and "Traceback (most recent call last)" in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(cases["config"][1])
    rc, out, err = results["finished"]   # saved and finished: 0, despite the abort at exit
    assert rc == 0, (rc, out[-2000:], err[-3000:])
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def strict_json(line):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_skip_stops_after_max_skipped_steps_and_saves_nothing_after(tmp_path):
    """Iteration 2: an inf gradient (finite loss) is skipped and said so; from iteration 4 the loss
    is NaN for good: skipped 4, 5, 6, then the run stops (--max-skipped-steps 3) with a sentence.
    --save-interval 1: saved 1 and 3 (never inside a run of skipped steps), nothing after 3."""
    ck, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    rc, out, err = finish(start(
        TINY + ["--train-iters", "12", "--nonfinite-loss", "skip", "--max-skipped-steps", "3",
                "--save", str(ck), "--save-interval", "1", "--metrics-jsonl", str(metrics)],
        MEGATRON_SP_INJECT_INF_GRAD_AT_ITER=2, MEGATRON_SP_INJECT_NAN_AT_ITER="4-20"))
    assert_one_sentence(rc, out, err, "error: iterations 4-6: 3 optimizer steps in a row were "
                        "skipped for a non-finite loss or gradient norm (last: loss nan and "
                        "gradient norm nan; --max-skipped-steps 3), so the run has diverged: "
                        "stopping with nothing saved after iteration 3; resume from the last "
                        "checkpoint")
    assert "iteration 2: non-finite gradient norm inf (the loss 6." in out, out
    assert "is finite): optimizer step skipped (--nonfinite-loss skip; 1 in a row" in out, out
    for it, n in ((4, 1), (5, 2), (6, 3)):
        assert (f"iteration {it}: non-finite loss nan and gradient norm nan: optimizer step "
                f"skipped (--nonfinite-loss skip; {n} in a row") in out, out
    assert sorted(os.listdir(ck)) == ["iter_0000001", "iter_0000003",
                                      "latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    records = [strict_json(line) for line in metrics.read_text().splitlines()]   # valid JSON
    by_iter = {r["iteration"]: r for r in records}
    assert sorted(by_iter) == [1, 2, 3, 4, 5]
    assert by_iter[2]["grad_norm"] is None and by_iter[2]["lm_loss"] > 0     # inf -> null
    assert by_iter[4]["lm_loss"] is None and by_iter[5]["grad_norm"] is None  # nan -> null
    assert by_iter[5]["skipped_iterations_total"] == 3
