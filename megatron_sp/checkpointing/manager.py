"""The training loop's side of checkpoints: --save/--load/--save-interval, pre-emption signals and
the exit conditions."""
from __future__ import annotations

import signal
import sys
import time

from megatron_sp.checkpointing import megatron_lm
from megatron_sp.checkpointing.comm import global_rank, agree_on_error, any_rank_flag
from megatron_sp.checkpointing.format import AgreedCheckpointError, CheckpointError
from megatron_sp.checkpointing.io import (async_save_failed, async_save_in_flight,
                                          finalize_async_save, load_checkpoint, save_checkpoint)
from megatron_sp.checkpointing.lock import SaveLock, fresh_run_problem, track
from megatron_sp.checkpointing.preflight import checkpoint_bytes, startup_problems


# Pre-emption ---------------------------------------------------------------------------------------

class SignalHandler:
    """Record SIGTERM / SIGUSR1 instead of dying; the loop saves and exits at an iteration's end."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.received = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum
        print(f"> rank {global_rank()}: received signal {signal.Signals(signum).name}; will save and exit "
              f"at the end of this iteration", file=sys.stderr, flush=True)

    def release(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


# The training loop's side: --save/--load/--save-interval and the exit conditions -------------------

class CheckpointManager:
    """Megatron's checkpoint and exit flags around a `Trainer` (one per run, every rank).

        manager = CheckpointManager(job, trainer, model_config)
        manager.start()                      # the --save lock, start-up checks (collective)
        manager.load()                       # --load (--no-load-optim, --no-load-rng, --finetune,
                                             #   --ckpt-step, --no-verify-checkpoint, schedule flags)
        while ...: trainer.train_step(...); if manager.after_step(): break
        manager.finish()                     # final save, async saves published, handlers and
                                             #   the lock released (release() on any other exit)

    `job`: the run's megatron_sp.config.JobConfig; its checkpoint section holds the flags, and its
    flat record (`job.flags()`, with the iteration training stops at) is stored with every save as
    the checkpoint's "args". After each iteration the ranks agree (one all-reduce of two flags,
    `any_rank_flag`) on whether a signal arrived (--exit-signal-handler) or --exit-duration-in-mins
    is spent; together with --exit-interval and --save-interval that decides to save (when --save is
    given) and to stop. While an asynchronous save is in flight the same all-reduce carries a third
    flag, its failure on any rank: the run stops at that step with the save's one sentence.
    """

    def __init__(self, job, trainer, config=None):
        self.job, self.options, self.trainer, self.config = job, job.checkpoint, trainer, config
        self.mesh = trainer.mesh
        self.start_time = time.time()
        self.last_saved = None
        self.exit_reason = None
        self.end_iteration = job.training.end_iteration()
        self.lock = None
        self.signals = SignalHandler() if self.options.exit_signal_handler else None

    def start(self) -> None:
        """Before the first step (collective): rank 0 takes the --save lock and refuses a fresh run
        into another run's checkpoints (lock.py); every rank checks the folders it writes
        (preflight.py). The ranks agree: all raise the same CheckpointError, none waits."""
        o, job = self.options, self.job
        problem, lock_error = None, None
        if global_rank() == 0 and o.save:
            try:
                lock = SaveLock(o.save, force=o.force_unlock)
                note = lock.acquire()
                self.lock = track(lock)
                if note:
                    print(note, flush=True)
                problem = fresh_run_problem(o.save, o.load, o.overwrite_save)
            except CheckpointError as err:
                problem = str(err)
            except OSError as err:      # an unwritable --save: the start-up checks say why
                lock_error = (f"cannot take the lock of --save {o.save} ({err.strerror or err}); "
                              f"check the folder.")
        if problem is None:
            problems = startup_problems(
                global_rank(), o.save, self._checkpoint_size(), skip_free_space=o.skip_free_space_check,
                tensorboard_dir=job.logging.tensorboard_dir, metrics_jsonl=job.logging.metrics_jsonl,
                data_cache_path=None if job.data.mock_data else job.data.data_cache_path)
            problem = problems[0] if problems else lock_error
        problem = agree_on_error(problem)
        if problem is not None:
            self.release()
            raise AgreedCheckpointError(problem)

    def _checkpoint_size(self) -> int | None:
        """About the bytes of one checkpoint of this run (preflight.checkpoint_bytes)."""
        if self.config is None:
            return None
        t = self.job.training
        first = next(self.trainer.chunks[0].parameters(), None)
        moments = 0 if self.options.no_save_optim else (
            2 if t.optimizer == "adam" else 1 if t.sgd_momentum else 0)
        return checkpoint_bytes(self.config.num_parameters(),
                                first.element_size() if first is not None else 4, moments)

    def release(self) -> None:
        """Release the --save lock (rank 0; idempotent): at the end, and on any other exit."""
        if self.lock is not None:
            self.lock.release()

    def _rng_tracker(self):
        return getattr(self.trainer.chunks[0], "rng_tracker", None)

    def load(self) -> dict | None:
        """--load into the trainer; afterwards `end_iteration` is the iteration training stops at
        (with --train-samples it follows the loaded consumed samples)."""
        o, t = self.options, self.trainer
        if not o.load:
            return None
        megatron_folder = megatron_lm.megatron_lm_folder(o.load, o.ckpt_step)
        if megatron_folder is not None:      # a Megatron-LM save (megatron_lm/resume.py)
            meta = megatron_lm.load_for_training(
                megatron_folder, t.chunks, self.mesh, optimizer=t.optimizer, scheduler=t.scheduler,
                train_state=t.state, config=self.config, finetune=o.finetune,
                schedule=self._schedule_policy())
        else:
            meta = load_checkpoint(o.load, t.chunks, self.mesh, optimizer=t.optimizer,
                                   scheduler=t.scheduler, train_state=t.state, config=self.config,
                                   rng_tracker=self._rng_tracker(), load_optim=not o.no_load_optim,
                                   load_rng=not o.no_load_rng, finetune=o.finetune,
                                   step=o.ckpt_step, verify=not o.no_verify_checkpoint,
                                   schedule=self._schedule_policy())
        if meta is None and global_rank() == 0:
            print(f"> no checkpoint found under --load {o.load}: starting from scratch", flush=True)
        self.last_saved = t.state.iteration if meta is not None and not o.finetune else None
        self.end_iteration = self.job.training.end_iteration(t.state.iteration,
                                                             t.state.consumed_train_samples)
        return meta

    def _schedule_policy(self) -> str | None:
        """Which learning-rate schedule wins when it differs from the checkpoint's (Megatron's
        flags): "override" (the command line), "checkpoint", or None (refuse the difference)."""
        if self.options.override_opt_param_scheduler:
            return "override"
        return "checkpoint" if self.options.use_checkpoint_opt_param_scheduler else None

    def save(self):
        o, t = self.options, self.trainer
        if not o.save or self.last_saved == t.state.iteration:
            return
        record = dict(self.job.flags(), train_iters=self.end_iteration)
        save_checkpoint(o.save, t.state.iteration, t.chunks, self.mesh,
                        optimizer=None if o.no_save_optim else t.optimizer,
                        scheduler=t.scheduler, train_state=t.state, config=self.config, args=record,
                        rng_tracker=self._rng_tracker(), async_save=o.async_save,
                        save_rng=not o.no_save_rng)
        self.last_saved = t.state.iteration

    def after_step(self) -> bool:
        """Save and/or decide to stop after an iteration; True means leave the training loop."""
        o, it = self.options, self.trainer.state.iteration
        duration = o.exit_duration_in_mins
        signal_flag, time_flag = False, False
        if self.signals is not None or duration or async_save_in_flight():
            local_time = bool(duration) and (time.time() - self.start_time) / 60.0 > duration
            local_signal = self.signals is not None and self.signals.received is not None
            signal_flag, time_flag, save_failed = any_rank_flag([local_signal, local_time,
                                                                 async_save_failed()])
            if save_failed:   # said now, not at the next save: every rank raises its sentence
                finalize_async_save()
        interval = o.exit_interval
        if signal_flag:
            self.exit_reason = "a signal (SIGTERM/SIGUSR1)"
        elif time_flag:
            self.exit_reason = f"--exit-duration-in-mins {duration}"
        elif interval and it % interval == 0:
            self.exit_reason = f"--exit-interval {interval}"
        if self.exit_reason or (o.save_interval and it % o.save_interval == 0):
            self.save()
        if self.exit_reason and global_rank() == 0:
            print(f"> exiting at iteration {it} after {self.exit_reason}", flush=True)
        return self.exit_reason is not None

    def finish(self):
        """End of training: save the last iteration, publish an async save, release handlers."""
        if self.trainer.state.iteration > 0 or self.exit_reason:
            self.save()
        finalize_async_save()
        if self.signals is not None:
            self.signals.release()
        self.release()
