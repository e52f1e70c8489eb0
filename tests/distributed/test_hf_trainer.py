"""transformers.Trainer and trl.SFTTrainer (packing on) made sequence-parallel with
megatron_sp.hf.trainer reproduce the unmodified trainer's loss curve on one process.

Reference: the unmodified Trainer / SFTTrainer, one process (this pytest process), same tiny random
model (built from a config, seeded), same in-memory data, same TrainingArguments. Candidates: the
same script with the two changed lines, under
- 2 ranks spawned (megatron_sp.testing.run_distributed): sp 2 (Trainer on llama), cp 2 (the ring
  alone: SFTTrainer on qwen3 with packing, documents crossing the zigzag chunks);
- 4 ranks under `accelerate launch --multi_gpu --num_processes 4` (accelerate's launcher, torchrun
  underneath; `--multi_gpu` with use_cpu=True is how accelerate starts several CPU processes: its
  `--cpu` starts one): sp 2 x cp 2 (Trainer, llama, with activation checkpointing: the recompute
  repeats the all-to-alls and the ring), dp 2 x cp 2 (Trainer, qwen3; per-replica batch half the
  reference's, so tokens per optimizer step are equal), sp 4 (Trainer, llama, GQA kv heads 2 < sp:
  replicated), sp 2 x cp 2 and dp 2 x cp 2 (SFTTrainer, qwen3, packing).
Every run: 3 optimizer steps, gradient accumulation 2 (Trainer), padding (right), and an eval at
the end. Tolerance: every logged training loss and the eval loss to 1e-5 relative; also
max_steps, the Trainer's total batch size and every rank's identical curve; rank 0 said the
one start-up line (layout, attention, documents).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

STEPS = 3
RTOL = 1e-5
VOCAB = 64
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The job: a tiny model, data and one trainer run ----------------------------------------------

def tiny_model(family: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    config = cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=False)
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                            dtype=torch.float32)


def lm_examples(n: int, seed: int) -> list[dict]:
    """Token sequences of 9..40 tokens; the first few labels masked (a prompt), as a collator-less
    dataset of python lists."""
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(9, 41))]
        prompt = rng.randrange(0, 5)
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def pad_collate(features: list[dict]) -> dict:
    """Right padding: input_ids with 0, labels with -100, attention_mask."""
    import torch
    s = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), s, dtype=torch.long)
    labels = torch.full((len(features), s), -100, dtype=torch.long)
    mask = torch.zeros(len(features), s, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.tensor(f["input_ids"])
        labels[i, :n] = torch.tensor(f["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def word_tokenizer():
    """A whitespace word-level tokenizer over VOCAB words, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<pad>")


def sft_texts(n: int, seed: int):
    import random

    from datasets import Dataset
    rng = random.Random(seed)
    texts = [" ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(rng.randrange(4, 30)))
             for _ in range(n)]
    return Dataset.from_dict({"text": texts})


def train_once(kind: str, family: str, sp_size: int | None, batch: int, out_dir: str,
               cp_size: int = 1, checkpointing: bool = False) -> dict:
    """One run; sp_size None: the unmodified trainer. Returns the logged curve and step counts."""
    import logging

    import transformers
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    common = dict(output_dir=out_dir, per_device_train_batch_size=batch,
                  per_device_eval_batch_size=batch, max_steps=STEPS, learning_rate=2e-3,
                  logging_steps=1, eval_strategy="steps", eval_steps=STEPS, save_strategy="no",
                  report_to="none", use_cpu=True, seed=7, disable_tqdm=True,
                  dataloader_num_workers=0, activation_checkpointing=checkpointing)
    model = tiny_model(family)
    if kind == "trainer":
        from transformers import Trainer, TrainingArguments
        from megatron_sp.hf.trainer import SequenceParallelTrainer
        args = TrainingArguments(gradient_accumulation_steps=2, remove_unused_columns=False, **common)
        cls, extra = (Trainer, {}) if sp_size is None else (
            SequenceParallelTrainer, {"sp_size": sp_size, "cp_size": cp_size})
        trainer = cls(model=model, args=args, train_dataset=lm_examples(48, 1),
                      eval_dataset=lm_examples(8, 2), data_collator=pad_collate, **extra)
    else:
        from trl import SFTConfig, SFTTrainer
        from megatron_sp.hf.trainer import sequence_parallel_trainer
        # bf16=False: SFTConfig defaults to bf16 autocast, which no layout reproduces to 1e-5.
        args = SFTConfig(packing=True, max_length=48, gradient_accumulation_steps=1, bf16=False,
                         **common)
        cls, extra = (SFTTrainer, {}) if sp_size is None else (
            sequence_parallel_trainer(SFTTrainer), {"sp_size": sp_size, "cp_size": cp_size})
        trainer = cls(model=model, args=args, processing_class=word_tokenizer(),
                      train_dataset=sft_texts(40, 3), eval_dataset=sft_texts(8, 4), **extra)
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer.train()
    history = trainer.state.log_history
    return {"loss": [h["loss"] for h in history if "loss" in h],
            "eval_loss": [h["eval_loss"] for h in history if "eval_loss" in h],
            "max_steps": trainer.state.max_steps,
            "total_batch": trainer.get_total_train_batch_size(trainer.args),
            "said": [line for line in err.getvalue().splitlines()
                     if line.startswith("megatron_sp.hf:")]}


# Parallel jobs: (kind, family, sp, cp, per-replica batch, activation checkpointing) -----------

SPAWN_JOBS = [("trainer", "llama", 2, 1, 4, False), ("sft", "qwen3", 1, 2, 2, False)]
LAUNCH_JOBS = [("trainer", "llama", 2, 2, 4, True), ("trainer", "qwen3", 1, 2, 2, False),
               ("trainer", "llama", 4, 1, 4, False), ("sft", "qwen3", 2, 2, 2, False),
               ("sft", "qwen3", 1, 2, 1, False)]


def reference_key(job) -> tuple:
    """The one-process run a job compares to: the same kind and family, batch x dp."""
    kind, family, sp, cp, batch, _ = job
    return kind, family, batch * (WORLD[job] // (sp * cp))


WORLD = {**{job: 2 for job in SPAWN_JOBS}, **{job: 4 for job in LAUNCH_JOBS}}


def _run_jobs(jobs, rank, out_dir):
    return [train_once(kind, family, sp, batch, os.path.join(out_dir, f"r{rank}"), cp_size=cp,
                       checkpointing=checkpointing)
            for kind, family, sp, cp, batch, checkpointing in jobs]


def _spawned(rank, world, jobs, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    return _run_jobs(jobs, rank, out_dir)


def _torchrun_main(out_path: str, out_dir: str):
    """Entry point under accelerate launch: every rank writes its results to
    out_path.<rank>.json."""
    import torch
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = _run_jobs(LAUNCH_JOBS, rank, out_dir)
    with open(f"{out_path}.{rank}.tmp", "w") as f:
        json.dump(results, f)
    os.replace(f"{out_path}.{rank}.tmp", f"{out_path}.{rank}.json")
    # Leave as pretrain_gpt does (barrier, groups destroyed, no interpreter finalization to race
    # with gloo's worker threads: test_readme_hf.py's SIGABRT on a loaded CI machine).
    from megatron_sp.reporting import exit_process
    from megatron_sp.mesh import shutdown
    shutdown()
    exit_process(0)


def _assert_close(name, ref, got):
    assert len(got["loss"]) == len(ref["loss"]) == STEPS, (name, ref, got)
    assert len(got["eval_loss"]) == len(ref["eval_loss"]) == 1, (name, ref, got)
    for a, b in zip(ref["loss"] + ref["eval_loss"], got["loss"] + got["eval_loss"]):
        assert abs(a - b) <= RTOL * abs(a), (name, ref, got)
    assert (got["max_steps"], got["total_batch"]) == (ref["max_steps"], ref["total_batch"]), \
        (name, ref, got)


def _said_once(name, per_rank, job):
    """Rank 0 said the start-up line (layout, attention, documents); the others nothing."""
    kind, family, sp, cp, batch, _ = job
    dp = WORLD[job] // (sp * cp)
    (line,) = per_rank[0]["said"]
    assert line.startswith(f"megatron_sp.hf: dp {dp} x sp {sp} x cp {cp} (world {WORLD[job]}); "
                           f"attention: "), (name, line)
    assert ("ring attention over cp" in line) == (cp > 1), (name, line)
    said = "packed documents detected" if kind == "sft" else "padding detected"
    assert said in line, (name, line)          # TRL's packing gives position_ids; pad_collate pads
    assert all(r["said"] == [] for r in per_rank[1:]), (name, per_rank)


@pytest.mark.timeout(600)      # 9 trainer processes' start-up (transformers, trl) on 2 cores
def test_trainer_and_sft_trainer_match_one_process(tmp_path):
    from megatron_sp.testing import free_port, run_distributed

    out = tmp_path / "launch"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
           "4", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), os.path.abspath(__file__), str(out),
           str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    launched = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        spawned = run_distributed(_spawned, 2, SPAWN_JOBS, str(tmp_path / "spawn"),
                                  timeout_s=240.0, collective_timeout_s=120.0)
        references = {reference_key(job): None for job in SPAWN_JOBS + LAUNCH_JOBS}
        for kind, family, batch in references:
            references[(kind, family, batch)] = train_once(kind, family, None, batch,
                                                           str(tmp_path / "ref"))
        log, _ = launched.communicate(timeout=300)
    finally:
        if launched.poll() is None:
            launched.kill()
            launched.wait()
    assert launched.returncode == 0, log[-6000:]
    ranks = [json.load(open(f"{out}.{r}.json")) for r in range(4)]
    results = {job: [spawned[r][i] for r in range(2)] for i, job in enumerate(SPAWN_JOBS)}
    results.update({job: [ranks[r][i] for r in range(4)] for i, job in enumerate(LAUNCH_JOBS)})
    for job, per_rank in results.items():
        _said_once(job, per_rank, job)
        curves = [{k: v for k, v in r.items() if k != "said"} for r in per_rank]
        assert all(c == curves[0] for c in curves), (job, per_rank)   # every rank the same
        _assert_close(job, references[reference_key(job)], per_rank[0])


# Resuming in another layout, and sp ranks given different batches (issue 34) -------------------

def _layout_and_batches(rank, world, out_dir):
    """On 2 ranks: a Trainer run at sp 2 saves a checkpoint, resumed at sp 1 (dp 2); then
    shard_batch over the sp pair with equal and with different batches."""
    import contextlib
    import io
    import logging

    import torch
    import transformers
    from transformers import TrainingArguments

    from megatron_sp.hf import SequenceParallelError, shard_batch, shard_for_rank
    from megatron_sp.hf.trainer import LAYOUT_FILE, SequenceParallelTrainer
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    said = {}

    def run(sp_size, max_steps, resume):
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4,
                                 max_steps=max_steps, learning_rate=1e-3, save_strategy="steps",
                                 save_steps=2, report_to="none", use_cpu=True, seed=7,
                                 disable_tqdm=True, remove_unused_columns=False,
                                 dataloader_num_workers=0)
        trainer = SequenceParallelTrainer(model=tiny_model("llama"), args=args,
                                          train_dataset=lm_examples(32, 1),
                                          data_collator=pad_collate, sp_size=sp_size)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            trainer.train(resume_from_checkpoint=resume)
        notes = [line for line in err.getvalue().splitlines() if line.startswith("note:")]
        return notes, trainer.get_total_train_batch_size(trainer.args)

    said["first"] = run(2, 2, None)
    with open(os.path.join(out_dir, "checkpoint-2", LAYOUT_FILE)) as f:
        said["layout"] = json.load(f)
    said["resumed"] = run(1, 3, True)

    def batch(seed):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (2, 8), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}

    group = torch.distributed.group.WORLD
    same = shard_batch(batch(0), group)
    said["same"] = torch.equal(same["input_ids"], shard_for_rank(batch(0), rank, 2)["input_ids"])
    swapped = batch(0) if rank == 0 else {k: v.flip(0) for k, v in batch(0).items()}
    for name, mine in (("different", batch(rank)), ("rows swapped", swapped)):
        try:
            shard_batch(mine, group)
            said[name] = None
        except SequenceParallelError as err:
            said[name] = str(err)
    said["unchecked"] = shard_batch(batch(rank), group, same_batch=False)["input_ids"].shape[1]
    return said


def test_resume_in_another_layout_and_different_batches_are_said(tmp_path):
    """One 2-rank spawn: a checkpoint saved at sp 2 (dp 1, global batch 4) resumed at sp 1 on 2
    ranks (dp 2: global batch 8) trains on after one note on rank 0 naming both layouts and
    batches; shard_batch refuses sp ranks given different batches (other values, other row
    order) in one sentence on both ranks, and same_batch=False turns the check off."""
    from megatron_sp.testing import run_distributed

    per_rank = run_distributed(_layout_and_batches, 2, str(tmp_path), timeout_s=240.0,
                               collective_timeout_s=120.0)
    zero, one = per_rank
    assert zero["layout"] == {"sp": 2, "cp": 1, "dp": 1, "global_batch": 4,
                              "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}
    assert zero["first"] == ([], 4) and one["first"] == ([], 4)     # nothing said on a fresh run
    (note,), total = zero["resumed"]          # one note, on rank 0 only
    assert total == 8 and one["resumed"] == ([], 8), (zero, one)
    assert note.startswith(
        f"note: resuming {tmp_path}/checkpoint-2, saved at sp 2 x dp 1 (global batch 4), at sp 1 x "
        f"dp 2: the global batch is now 8 sequences per optimizer step, not 4"), note
    assert note.endswith("; per_device_train_batch_size 2 keeps the global batch of 4."), note
    for said in per_rank:
        assert said["same"] and said["unchecked"] == 4, said
        for name in ("different", "rows swapped"):
            assert said[name] == zero[name] and said[name].startswith(
                "shard_batch: the 2 sp ranks of a data-parallel replica were given different "
                "batches") and "\n" not in said[name] and said[name].endswith("."), said


if __name__ == "__main__":          # under accelerate launch (the test above launches it)
    _torchrun_main(sys.argv[1], sys.argv[2])
