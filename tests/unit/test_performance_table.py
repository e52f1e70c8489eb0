"""docs/performance.md's generated tables equal what bench/performance_table.py makes of
bench/results/*.json; the generator takes a bench it does not know (a table of its own) and a file
written before the schema, and labels GPU and CPU tables."""
from __future__ import annotations

import json
import os

from megatron_sp.testing import load_script

table = load_script("bench/performance_table.py")


def test_docs_performance_md_equals_the_results_files():
    with open(table.DOC) as f:
        current = f.read()
    expected = table.regenerate(current, table.load_results())
    assert table.BEGIN in current and table.END in current, \
        f"docs/performance.md lost its markers: run {table.REGENERATE}"
    assert current == expected, (f"docs/performance.md differs from bench/results/*.json: run "
                                 f"{table.REGENERATE} and commit both")
    for name in sorted(os.listdir(table.RESULTS)):      # every results file has its table
        if name.endswith(".json"):
            assert f"`bench/results/{name}`" in current, name


def test_unknown_bench_and_pre_schema_files_get_their_own_labelled_tables(tmp_path):
    table.write_results("hf_ulysses_cpu", "hf_ulysses", [
        {"model": "qwen3-tiny", "sp": 2, "tokens_per_s": 1234.6, "mfu": 0.0123, "ok": True},
        {"model": "qwen3-tiny", "sp": 4, "tokens_per_s": 2000.0, "extra": "only here"}],
        device={"kind": "cpu", "name": "test cpu", "peak_tflops": None}, command="python x.py",
        folder=str(tmp_path))
    table.write_results("gpu_long_context_h200", "gpu_long_context",
                        [{"model": "llama-1b", "seq": 8192, "mfu": 0.42, "status": "ok"}],
                        device={"kind": "gpu", "name": "NVIDIA H200", "peak_tflops": 989.0,
                                "peak_note": "bf16 dense"},
                        columns=[("model", "model"), ("seq", "seq"), ("mfu", "MFU")],
                        command="python y.py", folder=str(tmp_path))
    legacy = {"command": "python bench/context_parallel.py", "torch": "2.13.0+cpu",
              "machine": "vm", "heads": 8, "rows": [{"mode": "ring", "seq": 4096,
                                                     "bytes": {"fwd": 1}, "times_s": [0.5]}],
              "crossovers": [{"degree": 2, "time_crossovers": ["a -> b"]}]}
    (tmp_path / "context_parallel_cpu.json").write_text(json.dumps(legacy))
    records = table.load_results(str(tmp_path))
    assert [r["bench"] for r in records] == ["gpu_long_context", "context_parallel_cpu",
                                             "hf_ulysses"]          # GPU first, then by file
    text = table.render_tables(records)
    assert "### GPU: gpu_long_context" in text and "MFU against 989 TFLOP/s (bf16 dense)" in text
    assert "| llama-1b | 8192 | 42.0% |" in text                    # its own columns, MFU in %
    assert "### CPU: hf_ulysses" in text
    assert "| model | sp | tokens_per_s | mfu | ok | extra |" in text
    assert "| qwen3-tiny | 4 | 2000 | - | - | only here |" in text
    assert "| qwen3-tiny | 2 | 1235 | 1.2% | yes | - |" in text
    assert "### CPU: context_parallel_cpu" in text and "| ring | 4096 |" in text
    assert "in the JSON only: bytes, times_s" in text and "settings: heads 8" in text
    assert "| 2 | a -> b |" in text                                 # the crossovers table
    doc = "# Performance\n\nprose\n"
    once = table.regenerate(doc, records)
    assert once.startswith(doc) and table.regenerate(once, records) == once   # prose kept, stable
