"""What accelerate would refuse with a traceback on every rank, said once in one sentence (issue 35).

SequenceParallelTrainer meets, before transformers.Trainer builds its Accelerator: a
`parallelism_config` with sp_size / cp_size (accelerate itself refuses it on CPU, "only
compatible DistributedType.FSDP ...", as a traceback on every rank), a DeepSpeed config and
`torch_compile=True` under sp / cp. The sentence names what to change; under torchrun the user's
script ends with one `error:` line (megatron_sp.reporting.say_user_errors: an uncaught UserError is
reported once across the ranks) and no traceback. The pure check (`_check_arguments`) is tested on
every case; one 2-rank torchrun launch shows the whole path of the parallelism_config case.
"""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_sp.errors import ConfigError
from megatron_sp.testing import finish_process, free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _said(**args):
    from megatron_sp.hf.trainer import _check_arguments
    sp, cp = args.pop("sp", 2), args.pop("cp", 1)
    try:
        _check_arguments(SimpleNamespace(**args), sp, cp)
    except ConfigError as err:
        return str(err)
    return None


def test_arguments_accelerate_cannot_run_are_one_sentence_naming_the_change():
    pc = SimpleNamespace(sp_size=2, cp_size=1)
    said = {
        "deepspeed": _said(deepspeed={"zero_optimization": {"stage": 2}}),
        "parallelism_config": _said(parallelism_config=pc),
        "both sizes": _said(parallelism_config=SimpleNamespace(sp_size=2, cp_size=2)),
        "compile": _said(torch_compile=True, cp=2, sp=1),
    }
    assert "remove deepspeed=" in said["deepspeed"] and "fsdp_version" in said["deepspeed"], said
    assert "sp_size=2" in said["parallelism_config"], said
    assert "remove parallelism_config=" in said["parallelism_config"], said
    assert "SequenceParallelTrainer(...)" in said["parallelism_config"], said
    assert "sp_size=2, cp_size=2" in said["both sizes"], said
    assert "torch_compile=False" in said["compile"], said
    for text in said.values():
        assert "\n" not in text and text.endswith("."), text
    # what is fine: no sizes in the parallelism_config, compile without sp / cp, no arguments
    assert _said(parallelism_config=SimpleNamespace(sp_size=1, cp_size=1)) is None
    assert _said(torch_compile=True, sp=1, cp=1) is None
    assert _said(deepspeed=None, parallelism_config=None, torch_compile=False) is None


SCRIPT = """\
import os, sys
sys.path.insert(0, {tests!r})
from accelerate import ParallelismConfig
from transformers import TrainingArguments
from megatron_sp.hf.trainer import SequenceParallelTrainer
from test_hf_trainer import lm_examples, pad_collate, tiny_model

args = TrainingArguments(output_dir={out!r}, use_cpu=True, report_to="none",
                         parallelism_config=ParallelismConfig(sp_size=2))
trainer = SequenceParallelTrainer(model=tiny_model("llama"), args=args,
                                  train_dataset=lm_examples(4, 1), data_collator=pad_collate)
trainer.train()
"""


@pytest.mark.timeout(240)
def test_parallelism_config_under_torchrun_is_one_line_no_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=os.path.join(REPO, "tests", "distributed"),
                                    out=str(tmp_path / "out")))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                             "2", "--master-port", str(free_port()), str(script)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    rc, out = finish_process(proc, 200)
    lines = [line for line in out.splitlines() if line.lstrip().startswith("error: ")]
    assert rc != 0 and len(lines) == 1, out[-4000:]
    assert "parallelism_config has sp_size=2" in lines[0], lines
    # no rank's traceback (its frames would name the script; torchrun's own launcher prints one
    # for its ChildFailedError, whose "Root Cause" block quotes our sentence as the traceback)
    assert f'File "{script}"' not in out and "ConfigError" not in out, out[-4000:]
    assert "ValueError: ParallelismConfig" not in out, out[-4000:]    # accelerate's own refusal
    assert f"traceback : {lines[0].strip()[len('error: '):]}" in out, out[-4000:]


def test_fsdp_that_accelerate_drops_on_cpu_is_said():
    """accelerate keeps FSDP only on GPUs: on CPU, fsdp= trains with DDP without a word from it
    (accelerate/state.py); our trainer says so in one note (tests/distributed/test_hf_fsdp2.py
    runs accelerate's FSDP2 path on CPU by patching that rule)."""
    from megatron_sp.hf.trainer import fsdp_dropped_note
    note = fsdp_dropped_note(True, False, "MULTI_CPU")
    assert note.startswith("note: accelerate ") and "MULTI_CPU run of fsdp=True is DDP" in note
    assert "\n" not in note and note.endswith("."), note
    assert fsdp_dropped_note(True, True, "FSDP") is None
    assert fsdp_dropped_note(False, False, "MULTI_CPU") is None
