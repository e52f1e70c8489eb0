"""The training loop: steps until the end iteration, the log line every --log-interval, evaluation
every --eval-interval, saves and exits through the CheckpointManager, --profile, --report-memory."""
from __future__ import annotations

import time

from megatron_sp import comm_stats
from megatron_sp.errors import DataError
from megatron_sp.memory import SavedTensorAccountant, format_report, peak_device_memory
from megatron_sp.sharding.state_bytes import format_state_bytes
from megatron_sp.training.metrics import StepClock, format_duration, format_log_line, print_rank0
from megatron_sp.training.profiling import StepProfiler


def fit(job, trainer, train_iter, valid_iter, metrics, checkpoints=None) -> None:
    """Train `trainer` on `train_iter` (micro-batches) until the checkpoint manager's end iteration
    (--train-iters, or what --train-samples leaves after a resume), or an exit condition."""
    end = checkpoints.end_iteration if checkpoints is not None else job.training.end_iteration()
    ramp = job.training.rampup()
    log, mesh = job.logging, trainer.mesh
    comm_stats.reset()
    profiler = StepProfiler.from_config(log, mesh, train_iters=end, save=job.checkpoint.save)
    start, last_logged = time.time(), trainer.state.iteration
    clock, steps = StepClock(), 0
    compiling = bool(job.training.torch_compile)   # this process's first step compiles the layers
    if compiling and trainer.state.iteration < end:   # said before it, whatever --log-interval
        from megatron_sp.compile import first_step_note as compiling_note
        print_rank0(mesh, compiling_note(job.training.torch_compile_backend))
    while trainer.state.iteration < end:
        if ramp is not None:          # --rampup-batch-size: this step's global batch
            trainer.set_global_batch_size(ramp.batch_size(trainer.state.consumed_train_samples))
        profiler.before_step(trainer.state.iteration + 1)
        nxt = trainer.state.iteration + 1
        logging = nxt % log.log_interval == 0 or nxt == end
        step_start = time.time()
        result, report = _step(trainer, _next_micro_batches(trainer, train_iter),
                               job.memory.report_memory and logging)
        seconds, steps = time.time() - step_start, steps + 1
        if not (compiling and steps == 1):    # a compiling step would make the ETA minutes long
            clock.add(seconds)
        it = trainer.state.iteration
        profiler.after_step(it)
        if steps == 1 and not logging:     # this process's first step: a sign of life, an ETA
            print_rank0(mesh, first_step_note(it, seconds, end - it, log.log_interval, compiling))
        if it % log.log_interval == 0 or it == end:
            record = trainer.log_record(result, time.time() - start, it - last_logged)
            if it < end:
                record["eta_s"] = clock.eta(end - it)
            memory = _memory_fields(trainer, record, report) if report is not None else None
            print_rank0(mesh, format_log_line(record, end, memory))
            metrics.write(record)
            comm_stats.reset()
            start, last_logged = time.time(), it
        if valid_iter is not None and job.training.eval_iters > 0 and (
                it % job.training.eval_interval == 0 or it == end):
            val = trainer.evaluate(valid_iter, job.training.eval_iters)
            print_rank0(mesh, f"validation at iteration {it} | lm loss: {val:.6E}")
            metrics.write({"iteration": it, "valid_lm_loss": val})
            start = time.time()
        if checkpoints is not None and trainer.consecutive_skipped:
            checkpoints.last_saved = it   # no save inside a run of skipped steps (a divergence?)
        if checkpoints is not None and checkpoints.after_step():   # saves; signal/exit flags
            break
    profiler.close()


def first_step_note(iteration: int, seconds: float, remaining: int, log_interval: int,
                    compiled: bool = False) -> str:
    """The line after this process's first step when no log line follows it: its time and, at
    its pace, the time the remaining iterations take (the first step is usually the slowest, so
    it errs long); none after a step that compiled the layers (--torch-compile)."""
    if compiled:
        pace = " (compiling included)"
    else:
        pace = (f"; at that pace the other {remaining} iterations take about "
                f"{format_duration(remaining * seconds)} (ETA)") if remaining > 0 else ""
    return (f"> first step (iteration {iteration}) done in {seconds:.1f} s{pace}; the log line "
            f"follows every {log_interval} iterations")


def _next_micro_batches(trainer, train_iter) -> list:
    """This step's micro-batches; the data running out is the user's sentence."""
    try:
        return [next(train_iter) for _ in range(trainer.num_micro_batches)]
    except StopIteration:
        raise DataError(
            f"the training data ran out at iteration {trainer.state.iteration} after "
            f"{trainer.state.consumed_train_samples} samples; raise the dataset's sample count "
            f"or lower --train-iters.") from None


def _step(trainer, micro_batches, account: bool):
    """One train step; with `account` (--report-memory on a logged step) also the saved-tensor
    report of that step."""
    if not account:
        return trainer.train_step(micro_batches), None
    accountant = SavedTensorAccountant().attach(trainer.chunks)
    with accountant.recording():
        result = trainer.train_step(micro_batches)
    accountant.detach()
    return result, accountant.report()


def _memory_fields(trainer, record: dict, report: dict) -> str:
    """--report-memory's fields of the log line (and their record entries)."""
    record["saved_bytes_per_rank"] = report["device_bytes"]
    record["offloaded_bytes_per_rank"] = report["host_bytes"]
    state_bytes = trainer.sharding.model_state_bytes(trainer.optimizer)
    record.update({f"model_state_{k}": v for k, v in state_bytes.items()})
    return (format_report(report, peak_device_memory(trainer.device)) + " | "
            + format_state_bytes(state_bytes))
