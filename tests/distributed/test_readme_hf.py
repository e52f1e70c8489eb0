"""The README's Hugging Face section runs as printed (issue 35).

Every ```python block of the section "## Hugging Face models" is taken from README.md as it is and
executed, never a copy kept here:
- a block marked `<!-- readme-test: torchrun 4 -->` (the plain loop) is a whole script: run under
  `python -m torch.distributed.run --nproc-per-node 4`, exactly as the README says to launch it;
- a block marked `<!-- readme-test: accelerate 4 -->` (the accelerate loop) is run under
  `accelerate launch --multi_gpu --num_processes 4` (this machine has no GPU: the README's CPU
  form of the command);
- the unmarked blocks (the Trainer's and SFTTrainer's two lines) are fragments that name the
  reader's own `model`, `args` / `config`, `ds` and `SFTTrainer`: each runs in the same torchrun
  job after a prelude that defines those names for a tiny random model and in-memory data (the
  prelude is below; the fragment is the README's text), then `trainer.train()`.
Checked: every launch exits 0, every loss it prints is finite and every fragment's Trainer ran its
steps at the layout the fragment asks for (sp 2 x cp 2 on 4 ranks).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECTION = "## Hugging Face models"
BLOCK = re.compile(r"(?:<!-- readme-test: (\w+) (\d+) -->\n)?```python\n(.*?)```", re.S)

# The names the Trainer fragments take from the reader's script.
PRELUDE = '''
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments
from trl import SFTConfig, SFTTrainer
from datasets import Dataset

torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, pad_token_id=0),
    attn_implementation="sdpa")
common = dict(output_dir=OUT, per_device_train_batch_size=2, max_steps=2, report_to="none",
              use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=1)
args = TrainingArguments(remove_unused_columns=False, **common)
config = SFTConfig(packing=True, max_length=32, bf16=False, dataset_text_field="text", **common)
ds = [{"input_ids": [3 + (i * 7 + j) % 60 for j in range(32)],      # the default collator
       "labels": [3 + (i * 7 + j) % 60 for j in range(32)]} for i in range(16)]   # stacks them
'''


def readme_blocks() -> list[tuple[str | None, int | None, str]]:
    """(launcher, ranks, code) of every python block of the README's Hugging Face section."""
    text = open(os.path.join(REPO, "README.md")).read()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return [(launcher or None, int(n) if n else None, code)
            for launcher, n, code in BLOCK.findall(text[start:end])]


def _fragment_job(out_path: str, out_dir: str, fragments: list[str], scripts: list[str]):
    """Under torchrun: the whole scripts as printed, then each fragment after the prelude."""
    import torch
    torch.set_num_threads(1)
    for code in scripts:
        exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    results = []
    for i, fragment in enumerate(fragments):
        names = {"__name__": "__main__", "OUT": os.path.join(out_dir, f"f{i}")}
        exec(compile(PRELUDE, "prelude", "exec"), names)
        if "SFTTrainer" in fragment:    # SFT takes text: the same tokens as words of a tokenizer
            from test_hf_trainer import sft_texts, word_tokenizer
            names["ds"] = sft_texts(16, 1)
            fragment = fragment.replace("train_dataset=ds,",
                                        "train_dataset=ds, processing_class=TOKENIZER,")
            names["TOKENIZER"] = word_tokenizer()
        exec(compile(fragment, "README.md", "exec"), names)
        trainer = names["trainer"]
        trainer.train()
        m = trainer.mesh
        results.append({"layout": [m.dp_size, m.sp_size, m.cp_size],
                        "steps": trainer.state.global_step,
                        "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h]})
    rank = int(os.environ["RANK"])
    with open(f"{out_path}.{rank}.tmp", "w") as f:
        json.dump(results, f)
    os.replace(f"{out_path}.{rank}.tmp", f"{out_path}.{rank}.json")
    # Leave as pretrain_gpt does: barrier, destroy the groups, no interpreter finalization (a gloo
    # worker thread taking the GIL during it can abort a finished process: SIGABRT on a loaded CI
    # machine). The README's own script ends where its code ends; this job's process is ours.
    from megatron_sp.reporting import exit_process
    from megatron_sp.mesh import shutdown
    shutdown()
    exit_process(0)


def _launch(cmd: list[str], timeout: float) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests", "distributed")]))
    done = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if done.returncode != 0:     # the whole tail, unabridged: which rank said what before it ended
        pytest.fail(f"{' '.join(cmd)}\nexited {done.returncode}; its output's last 8000 "
                    f"characters:\n{done.stdout[-8000:]}", pytrace=False)
    return done.stdout


def _printed_losses(log: str) -> list[float]:
    losses = [float(x) for x in re.findall(r"loss (-?[0-9.]+|nan|inf)", log)]
    assert losses and all(math.isfinite(x) for x in losses), log[-3000:]
    return losses


@pytest.mark.timeout(400)
def test_readme_hugging_face_snippets_run_as_printed(tmp_path):
    from megatron_sp.testing import free_port

    blocks = readme_blocks()
    scripts = {launcher: (n, code) for launcher, n, code in blocks if launcher}
    fragments = [code for launcher, _, code in blocks if launcher is None]
    assert set(scripts) == {"torchrun", "accelerate"} and len(fragments) == 2, blocks
    assert all("sp_size=2, cp_size=2" in f for f in fragments), fragments

    # the accelerate loop, as the README launches it on a CPU-only machine
    n, code = scripts["accelerate"]
    script = tmp_path / "train_accelerate.py"
    script.write_text(code)
    log = _launch([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                   "--num_processes", str(n), "--num_machines", "1", "--mixed_precision", "no",
                   "--dynamo_backend", "no", "--main_process_port", str(free_port()),
                   str(script)], timeout=180)
    assert len(_printed_losses(log)) == 4, log[-3000:]     # 8 rows / (dp 1 x batch 2)

    # the plain loop as a script under torchrun, then the Trainer fragments in the same job
    n, code = scripts["torchrun"]
    out = tmp_path / "fragments"
    runner = tmp_path / "run_fragments.py"
    runner.write_text(
        "import json, sys\n"
        "from test_readme_hf import _fragment_job\n"
        "_fragment_job(sys.argv[1], sys.argv[2], json.load(open(sys.argv[3])),\n"
        "              json.load(open(sys.argv[4])))\n")
    (tmp_path / "fragments.json").write_text(json.dumps(fragments))
    (tmp_path / "scripts.json").write_text(json.dumps([code]))
    log = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                   "--master-port", str(free_port()), str(runner), str(out), str(tmp_path),
                   str(tmp_path / "fragments.json"), str(tmp_path / "scripts.json")], timeout=300)
    assert len(re.findall(r"step \d: loss", log)) == 3, log[-3000:]   # rank 0's three lines
    _printed_losses(log)
    per_rank = [json.load(open(f"{out}.{r}.json")) for r in range(n)]
    for results in per_rank:
        assert results == per_rank[0], per_rank
        for got in results:
            assert got["layout"] == [1, 2, 2] and got["steps"] == 2, results
            assert len(got["loss"]) == 2 and all(math.isfinite(x) for x in got["loss"]), results
