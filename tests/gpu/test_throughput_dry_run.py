"""bench/gpu_throughput.py (the one GPU script's throughput item) on CPU with --dry-run: its row list,
each row measured on a tiny model of the same preset, and the results JSON in docs/performance.md's
schema. Runs in the normal suite (no GPU needed): the GPU rows themselves need a GPU (say so).

The dry run measures eager and compiled (Dynamo's "eager" backend here, for speed), ours and
Hugging Face on the same weights; FlexAttention rows either train or record "not available"
(torch 2.13 has no flex backward on CPU)."""
from __future__ import annotations

import json

from megatron_sp.testing import load_script

bench = load_script("bench/gpu_throughput.py")
table = load_script("bench/performance_table.py")


def test_row_list_covers_the_issue():
    rows = bench.plan_rows(["llama-1b", "llama-8b-shaped"], [8192, 32768])
    assert len(rows) == 2 * 2 * 2 * 4                 # seq x model x compiled x (hf + 3 ours)
    assert rows[0]["model"] == "llama-8b-shaped" and rows[0]["seq"] == 8192   # the goal rows first
    ours = {(r["attention"], r["documents"]) for r in rows if r["impl"] == "ours"}
    assert ours == {("sdpa", False), ("flex", False), ("flex", True)}
    assert all(r["attention"] == "sdpa" and not r["documents"] for r in rows if r["impl"] == "hf")
    # the 8B-shaped model's layers on an H200 (139 GiB): fewer at 32K than at 8K, never all 32
    at_8k, at_32k = bench.layers_that_fit(8192, 139.0), bench.layers_that_fit(32768, 139.0)
    assert 1 <= at_32k <= at_8k < 32, (at_8k, at_32k)


def test_dry_run_writes_the_schema(tmp_path):
    assert bench.main(["--dry-run", "--models", "llama-1b", "--compile-backend", "eager",
                       "--results-dir", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_throughput_dry_run_cpu.json").read_text())
    assert record["schema"] == table.SCHEMA and record["bench"] == "gpu_throughput"
    assert record["device"]["kind"] == "cpu" and record["device"]["peak_tflops"] is None
    rows = record["rows"]
    assert len(rows) == 8 and {tuple(c) for c in record["columns"]} == set(bench.COLUMNS)
    for r in rows:
        if r["attention"] == "sdpa":      # ours and HF, eager and compiled, all trained a step
            assert r["status"] == "ok" and r["tokens_per_s"] > 0, r
            assert r["mfu"] is None                     # no peak on a CPU: no MFU invented
        else:
            assert r["status"] == "ok" or r["status"].startswith("not available"), r
    ours = [r for r in rows if r["impl"] == "ours" and r["attention"] == "sdpa"]
    assert all(r["vs_hf"] and r["vs_hf"] > 0 for r in ours)
    text = table.render_tables(table.load_results(str(tmp_path)))
    assert "### CPU: training throughput" in text and "| llama-1b | 2 | 64 | hf | sdpa |" in text


def test_long_context_rows_in_the_schema(tmp_path):
    """bench/gpu_long_context.py's rows (a measured and an error row, as its children report them)
    become a schema file named after the attention and documents; its table labels the device."""
    import argparse
    long_context = load_script("bench/gpu_long_context.py")
    from megatron_sp.models import preset
    args = argparse.Namespace(model="llama-1b", attention="flex", documents=True, start_seq=32768,
                              results="gpu_long_context_{gpu}", results_dir=str(tmp_path))
    rows = [dict(technique="all", attention="flex", documents=True, max_seq=131072, peak_gb=80.5,
                 planner_peak_gb=78.0, planner_max_seq=262144, mfu_8k=None, mfu_32k=0.41,
                 stopped="oom"),
            dict(technique="plain", max_seq=None, peak_gb=None, planner_peak_gb=None,
                 planner_max_seq=0, mfu_8k=None, mfu_32k=None, stopped="error: no row")]
    path = long_context.write_schema_rows(rows, args, preset("llama-1b"), None)
    assert path.endswith("gpu_long_context_cpu_flex_documents.json")
    text = table.render_tables(table.load_results(str(tmp_path)))
    assert "| llama-1b | all | flex | yes | 131072 | 262144 | 80.5 | 78 | - | 41.0% | oom |" in text
    assert "| llama-1b | plain | - | - | - | 0 |" in text
