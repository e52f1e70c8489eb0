"""Megatron-LM compatibility (docs/design.md §10): the flag table, start-up mapping, the log line read by
train_llama3.sh's regular expressions, and the batch-size ramp-up and sample-counted schedule checked
against megatron-core's own calculator and scheduler (exact integers; lr to 1e-12 relative)."""
import os
import re
import warnings

import pytest
import torch

from megatron_sp.cli import megatron_compat as mc
from megatron_sp.cli.arguments import build_parser, parse_args
from megatron_sp.cli.build import parse_job
from megatron_sp.errors import ConfigError
from megatron_sp.training.optimizer import LRScheduler
from megatron_sp.training.rampup import BatchSizeRampup, schedule_steps
from megatron_sp.training import format_log_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARSER_FLAGS = set(build_parser()._option_string_actions)
BASE = ["--mock-data", "--seq-length", "32"]


def test_readme_table_is_the_generated_one():
    text = open(os.path.join(ROOT, "README.md")).read()
    begin, end = "<!-- megatron-flags-table: begin -->\n", "<!-- megatron-flags-table: end -->"
    table = text[text.index(begin) + len(begin):text.index(end)]
    assert table == mc.markdown_table(), "README table drifted: regenerate it with " \
        "python -m megatron_sp.cli.megatron_compat --markdown"


def test_every_categorised_flag_is_parsed_once():
    flags = [row[0] for row in mc.categories()]
    assert len(flags) == len(set(flags)), "a flag is in two categories"
    missing = [f for f in (*mc.HONOURED, *mc.MAPPED, *mc.NOOP, *mc.REFUSED) if f not in PARSER_FLAGS]
    assert not missing, missing


@pytest.mark.parametrize("value,ours", [("auto", "auto"), ("unfused", "unfused"), ("local", "sdpa"),
                                        ("te", "te"), ("sdpa", "sdpa"), ("flex", "flex"),
                                        ("flash-attn", "flash")])
def test_attention_backend_values(value, ours):
    assert parse_args(BASE + ["--attention-backend", value]).attention_backend == ours


def _flash_attn_installed():
    import importlib.util
    return importlib.util.find_spec("flash_attn") is not None


@pytest.mark.parametrize("argv,flag", [(["--attention-backend", "flash"], "--attention-backend flash"),
                                       (["--use-flash-attn"], "--use-flash-attn")])
def test_megatron_flash_is_flash_attn_or_sdpa_with_one_note(argv, flag):
    """Megatron's flash (the enum value, or --use-flash-attn) without flash-attn: SDPA and one note
    (issue 26 item 7); our flash-attn keeps asking for the package (refused when the model is built)."""
    args = parse_args(BASE + argv)
    has = _flash_attn_installed()
    assert args.attention_backend == ("flash" if has else "sdpa")
    notes = [n for n in args.megatron_notes if flag in n]
    assert len(notes) == 1, args.megatron_notes
    assert has or "runs as PyTorch's scaled_dot_product_attention" in notes[0]


def test_fused_attention_is_te_or_sdpa_with_a_note():
    args = parse_args(BASE + ["--attention-backend", "fused"])
    import importlib.util
    te = importlib.util.find_spec("transformer_engine") is not None
    assert args.attention_backend == ("te" if te else "sdpa")
    assert any("--attention-backend fused runs as" in n for n in args.megatron_notes)


def test_mapped_and_noop_flags_are_said_once():
    args = parse_args(BASE + ["--context-parallel-size", "2", "--use-flash-attn", "--use-mcore-models",
                              "--rerun-mode", "disabled", "--empty-unused-memory-level", "1",
                              "--no-rope-fusion", "--tiktoken-pattern", "v2"])
    assert args.context_parallel_size == 2
    assert args.attention_backend == ("flash" if _flash_attn_installed() else "sdpa")
    notes = args.megatron_notes
    assert sum("--use-flash-attn" in n for n in notes) == 1
    noop = [n for n in notes if "no-ops" in n]
    assert len(noop) == 1 and all(f in noop[0] for f in ("--use-mcore-models", "--rerun-mode",
                                                         "--empty-unused-memory-level",
                                                         "--no-rope-fusion", "--tiktoken-pattern"))


@pytest.mark.parametrize("argv,words", [
    (["--tensor-model-parallel-size", "4", "--sequence-parallel", "--num-experts", "4",
      "--expert-tensor-parallel-size", "2"], "other sizes are not implemented yet"),
    (["--moe-pad-expert-input-to-capacity"], "needs --moe-expert-capacity-factor"),
    (["--ckpt-format", "torch"], "torch_dist"),
    (["--lr-decay-samples", "100", "--train-iters", "10"], "--train-samples"),
    (["--global-batch-size", "8", "--rampup-batch-size", "3", "2", "10"], "multiple of INCR"),
])
def test_refusals_are_one_sentence(argv, words):
    with pytest.raises(ConfigError) as err:       # run_main prints it as "error: <message>"
        parse_job(BASE + argv)
    message = f"error: {err.value}"
    assert message.startswith("error: ") and words in message and "\n" not in message


def _train_llama3_sh_scrape(log: str, field: str) -> list[float]:
    """train_llama3.sh: grep -Eo '<field> [^|]*' | sed -E 's/.*<field> \\(<unit>\\): ([0-9\\.]+).*/\\1/'"""
    patterns = {"throughput per GPU": r".*throughput per GPU \(TFLOP\/s\/GPU\): ([0-9\.]+).*",
                "elapsed time per iteration": r".*elapsed time per iteration \(ms\): ([0-9\.]+).*"}
    values = []
    for match in re.findall(field + r" [^|]*", log):
        values.append(float(re.sub(patterns[field], r"\1", match)))
    return values


def scrape_log(log: str) -> dict:
    return {f: _train_llama3_sh_scrape(log, f)
            for f in ("throughput per GPU", "elapsed time per iteration")}


def test_log_line_is_megatrons_and_scraped_by_train_llama3_sh():
    record = {"iteration": 3, "consumed_samples": 24, "ms_per_iter": 812.25, "tflops_per_gpu": 2.37e-5,
              "lr": 1.5e-4, "global_batch_size": 8, "lm_loss": 6.25, "grad_norm": 1.5,
              "tokens_per_sec": 300.0, "skipped_iterations": 0, "nan_iterations": 0}
    line = format_log_line(record, 10)
    fields = [f.split(":")[0].strip() for f in line.split(" | ")]
    assert fields[:11] == ["iteration        3/      10", "consumed samples",
                           "elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)",
                           "learning rate", "global batch size", "lm loss", "loss scale", "grad norm",
                           "number of skipped iterations", "number of nan iterations"], fields
    assert line.startswith(" iteration") and line.endswith(" |")
    scraped = scrape_log(line + "\n" + line)
    assert scraped["throughput per GPU"] == [pytest.approx(2.37e-5, rel=1e-2)] * 2   # not 0.00
    assert scraped["elapsed time per iteration"] == [812.2, 812.2] or \
        scraped["elapsed time per iteration"] == [812.3, 812.3]


def _megatron_core_rampup(start, incr, samples, gbs, mbs, dp):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator
    return RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, False, 0, start, incr, samples)


@pytest.mark.parametrize("start,incr,samples,gbs,mbs,dp", [(16, 16, 5000, 128, 2, 4),
                                                          (2, 2, 12, 8, 1, 2), (4, 4, 40, 12, 2, 2)])
def test_rampup_follows_megatron_core(start, incr, samples, gbs, mbs, dp):
    ours = BatchSizeRampup(start, incr, samples, gbs)
    theirs = _megatron_core_rampup(start, incr, samples, gbs, mbs, dp)
    consumed, steps = 0, 0
    while consumed < 2 * samples + 3 * gbs:      # the ramp and a few steps after it
        theirs.update(consumed, consistency_check=True)
        assert ours.batch_size(consumed) == theirs.get_current_global_batch_size(), consumed
        assert ours.batch_size(consumed) // (mbs * dp) == theirs.get()   # micro-batches per rank
        consumed += ours.batch_size(consumed)
        steps += 1
    # Megatron's update_train_iters: ramp steps while consumed <= SAMPLES, then whole batches.
    train_samples = samples + 5 * gbs + 3
    iterations, consumed = 0, 0
    while consumed <= samples and consumed <= train_samples:
        theirs.update(consumed, consistency_check=False)
        consumed += theirs.get_current_global_batch_size()
        iterations += 1
    assert ours.train_iters(train_samples) == iterations + (train_samples - consumed) // gbs


def test_rampup_over_zero_samples_is_the_full_batch():
    assert BatchSizeRampup(4, 4, 0, 12).batch_size(0) == 12   # (megatron-core divides by zero)


@pytest.mark.parametrize("flags", [
    ["--train-samples", "400", "--lr-decay-samples", "360", "--lr-warmup-samples", "40"],
    ["--train-iters", "50", "--lr-decay-iters", "45", "--lr-warmup-iters", "5",
     "--rampup-batch-size", "2", "2", "60"],
    ["--train-samples", "400", "--lr-warmup-fraction", "0.1", "--rampup-batch-size", "2", "2", "60"],
    ["--train-samples", "400", "--lr-warmup-samples", "40", "--lr-wsd-decay-samples", "100",
     "--lr-decay-style", "WSD"],
])
def test_sample_counted_schedule_is_megatron_cores(flags):
    """Our LRScheduler in samples == megatron-core's OptimizerParamScheduler stepped by each batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    args = parse_job(BASE + ["--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-5",
                             "--lr-decay-style", "cosine"] + flags).training   # the last style wins
    warmup, decay, wsd = schedule_steps(args)
    param = torch.nn.Parameter(torch.zeros(1))
    ours = LRScheduler(torch.optim.SGD([param], lr=0.0), args.lr, args.min_lr, warmup, decay,
                       args.lr_decay_style, wsd)
    theirs_opt = torch.optim.SGD([param], lr=0.0)
    theirs = OptimizerParamScheduler(theirs_opt, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
                                     lr_warmup_steps=warmup, lr_decay_steps=decay,
                                     lr_decay_style=args.lr_decay_style, start_wd=0.0, end_wd=0.0,
                                     wd_incr_steps=1, wd_incr_style="constant", wsd_decay_steps=wsd,
                                     lr_wsd_decay_style="linear")
    ramp = args.rampup()
    consumed = 0
    for _ in range(args.train_iters):
        gbs = ramp.batch_size(consumed) if ramp else args.global_batch_size
        ours.step(gbs)
        theirs.step(gbs)
        consumed += gbs
        assert ours.lr == pytest.approx(theirs_opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
    assert consumed <= (args.train_samples or 10**9)


def test_cyclic_loader_repeats_shuffled_epochs_and_resumes():
    """--dataloader-type cyclic: each epoch is a permutation of the samples; a loader started at
    consumed samples c yields exactly the tail of one started at 0 (both dp ranks)."""
    from megatron_sp.data import PretrainingDataLoader

    class Ids:
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"tokens": [i]}

    def batches(consumed, rank, count):
        it = iter(PretrainingDataLoader(Ids(), consumed, 2, rank, 2, cyclic=True, seed=3))
        return [next(it)["tokens"].flatten().tolist() for _ in range(count)]

    full = [batches(0, r, 10) for r in (0, 1)]        # 10 steps x 4 samples = 4 epochs
    order = [x for step in zip(*full) for mb in step for x in mb]
    for epoch in range(4):
        assert sorted(order[10 * epoch:10 * epoch + 10]) == list(range(10)), epoch
    assert order[:10] != list(range(10)) and order[:10] != order[10:20]   # shuffled, per epoch
    for r in (0, 1):
        assert batches(12, r, 7) == full[r][3:], r


def test_exit_on_missing_checkpoint(tmp_path, capsys):
    import sys
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    argv = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", "8", "--train-iters", "1",
            "--load", str(tmp_path / "none"), "--exit-on-missing-checkpoint"]
    with pytest.raises(ConfigError) as err:       # run_main prints it as "error: <message>"
        pretrain_gpt.main(argv)
    assert f"error: {err.value}".startswith("error: --exit-on-missing-checkpoint: no checkpoint under --load")


@pytest.mark.parametrize("argv, ulysses, ring, note", [
    ([], 1, 1, None),
    (["--context-parallel-size", "4"], 1, 4, "--context-parallel-size 4 --cp-comm-type p2p: ring "
                                             "attention over 4 ranks (zigzag chunks): one sequence "
                                             "over 4 ranks"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a"], 4, 1,
     "--context-parallel-size 4 --cp-comm-type a2a runs as Ulysses --sequence-parallel-size 4"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
      "--hierarchical-context-parallel-sizes", "2", "2"], 2, 2,
     "Ulysses all-to-all over 2 adjacent ranks x ring attention over 2 ranks"),
    (["--context-parallel-size", "2", "--sequence-parallel-size", "2"], 2, 2,
     "one sequence over 4 ranks"),
])
def test_context_parallel_flags_keep_megatrons_meaning(argv, ulysses, ring, note):
    """Megatron's default --cp-comm-type is p2p (the ring); a2a is Ulysses; a2a+p2p both, with the
    sizes; our --sequence-parallel-size is Ulysses and composes with a ring (said at start-up)."""
    from megatron_sp.cli.build import parse_job
    parallel = parse_job(BASE + argv).parallel
    assert (parallel.sequence_parallel_size, parallel.ring_size) == (ulysses, ring)
    described = parallel.describe_context()
    assert (described is None) if note is None else (note in described)


@pytest.mark.parametrize("argv, words", [
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"], "A x R = --context-parallel-size 4"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
      "--hierarchical-context-parallel-sizes", "2", "3"], "got [2, 3]"),
    (["--context-parallel-size", "2", "--cp-comm-type", "allgather"], "allgather"),
    (["--hierarchical-context-parallel-sizes", "2", "2"], "applies to --cp-comm-type a2a+p2p"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--sequence-parallel-size", "2"],
     "disagree"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
      "--hierarchical-context-parallel-sizes", "-2", "-2"],
     "--hierarchical-context-parallel-sizes -2 -2 must be two positive integers A R (Ulysses ranks "
     "x ring ranks) whose product is --context-parallel-size 4; e.g. "
     "--hierarchical-context-parallel-sizes 2 2."),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
      "--hierarchical-context-parallel-sizes", "2", "2", "1"],
     "--hierarchical-context-parallel-sizes 2 2 1 must be two positive integers"),
    (["--context-parallel-size", "1", "--cp-comm-type", "a2a+p2p",
      "--hierarchical-context-parallel-sizes", "-1", "-1"], "e.g. --hierarchical-context-"
                                                            "parallel-sizes 1 1."),
    (["--sequence-parallel-size", "-2"], "--sequence-parallel-size must be >= 1, got -2."),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1, got 0."),
])
def test_context_parallel_refusals_are_one_sentence(argv, words):
    from megatron_sp.cli.build import parse_job
    with pytest.raises(ConfigError) as err:
        parse_job(BASE + argv)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert "torchrun" not in str(err.value)


def test_torchrun_hint_only_when_more_processes_fix_it(monkeypatch):
    """One process without a launcher: a layout of valid sizes that needs more processes gets the
    torchrun command; sizes that are themselves wrong (as a ParallelConfig built by the library
    without the command line's checks could hold) are said without it."""
    import types
    from megatron_sp.cli.startup_checks import check_world_size
    from megatron_sp.errors import UserError
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    layout = dict(tensor_model_parallel_size=2, sequence_parallel_size=1,
                  pipeline_model_parallel_size=1, ring_size=1)
    with pytest.raises(ConfigError, match=r"run it with `torchrun --nproc-per-node 2 pretrain_gpt"
                                          r"\.py --tensor-model-parallel-size 2`\.$"):
        check_world_size(types.SimpleNamespace(**layout), ["--tensor-model-parallel-size", "2"])
    for bad in (dict(sequence_parallel_size=-2), dict(ring_size=-2), dict(tensor_model_parallel_size=0)):
        with pytest.raises(UserError) as err:
            check_world_size(types.SimpleNamespace(**{**layout, **bad}), ["--flag"])
        assert "torchrun" not in str(err.value) and "positive integer" in str(err.value)
    check_world_size(types.SimpleNamespace(**{**layout, "tensor_model_parallel_size": 1}), [])

