"""Random-number streams for tensor parallelism (Megatron-LM's CUDA RNG tracker idea).

Two streams per rank:

- the default generator (torch's own), used outside tensor-parallel regions, e.g. hidden dropout
  on activations replicated over tp. It is seeded with

      default_seed = seed + 100 * pp_rank + 1009 * sp_rank

  identical across tp (and dp) ranks, as in Megatron (seed + 100 * pp_rank). Ulysses sp ranks hold
  different sequence chunks, so they get different streams (offset 1009 * sp_rank, chosen so that
  it does not collide with the pp offsets for realistic sizes); nothing replicated over sp is drawn
  from this generator (parameters are initialised from their own seeds).
- the "tensor-parallel" stream, entered with `tracker.fork()`, for dropout inside tp regions
  (attention dropout on the local heads, dropout on sequence-parallel activations): seeded with
  default_seed + 2718 + tp_rank, so it differs across tp ranks.

The tracker owns only the forked stream's saved state; the default generators stay torch's.
`get_rng_state()` / `set_rng_state()` capture the whole process (python, numpy, torch CPU, CUDA,
and a tracker) for checkpoints.
"""
from __future__ import annotations

import contextlib
import random

import torch

TP_SEED_OFFSET = 2718  # Megatron's offset of the model-parallel seed
PP_SEED_STRIDE = 100   # Megatron's per-pipeline-stage offset
SP_SEED_STRIDE = 1009  # ours, for Ulysses sequence-parallel ranks


def _cuda_in_use(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


class RNGTracker:
    """The default seed and the forked tensor-parallel RNG state of one rank.

    Args: seed (the --seed), this rank's tp/pp/sp coordinates, device ("cpu" or "cuda[:i]";
    default cuda when available). With `seed_default` (the default) the constructor seeds python's
    `random`, numpy and torch's default CPU/CUDA generators with `default_seed`.
    """

    def __init__(self, seed: int, tp_rank: int, pp_rank: int = 0, sp_rank: int = 0,
                 device=None, seed_default: bool = True):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.default_seed = seed + PP_SEED_STRIDE * pp_rank + SP_SEED_STRIDE * sp_rank
        self.tp_seed = self.default_seed + TP_SEED_OFFSET + tp_rank
        self._cpu_state = torch.Generator().manual_seed(self.tp_seed).get_state()
        self._cuda_state = self._initial_cuda_state() if _cuda_in_use(self.device) else None
        self._forked = False
        if seed_default:
            self.seed_default()

    def _initial_cuda_state(self) -> torch.Tensor:
        """The CUDA state seeded with tp_seed, leaving the device's current state untouched."""
        saved = torch.cuda.get_rng_state(self.device)
        torch.cuda.manual_seed(self.tp_seed)
        state = torch.cuda.get_rng_state(self.device)
        torch.cuda.set_rng_state(saved, self.device)
        return state

    def seed_default(self) -> None:
        """Seed python, numpy and torch's default generators with `default_seed`."""
        random.seed(self.default_seed)
        try:
            import numpy as np
            np.random.seed(self.default_seed % 2**32)
        except ImportError:
            pass
        torch.manual_seed(self.default_seed)  # also seeds every CUDA device

    @contextlib.contextmanager
    def fork(self):
        """Run the body on the tensor-parallel stream, then restore the default stream.

        The tensor-parallel stream continues where the previous fork left it.
        """
        if self._forked:
            raise RuntimeError("RNGTracker.fork() is already active: forks do not nest.")
        cuda = self._cuda_state is not None
        default_cpu = torch.get_rng_state()
        default_cuda = torch.cuda.get_rng_state(self.device) if cuda else None
        torch.set_rng_state(self._cpu_state)
        if cuda:
            torch.cuda.set_rng_state(self._cuda_state, self.device)
        self._forked = True
        try:
            yield
        finally:
            self._forked = False
            self._cpu_state = torch.get_rng_state()
            torch.set_rng_state(default_cpu)
            if cuda:
                self._cuda_state = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(default_cuda, self.device)

    def state_dict(self) -> dict:
        """Seeds and the tensor-parallel stream's state (tensors cloned)."""
        return {"default_seed": self.default_seed, "tp_seed": self.tp_seed,
                "cpu": self._cpu_state.clone(),
                "cuda": None if self._cuda_state is None else self._cuda_state.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (the seeds and the tensor-parallel stream)."""
        self.default_seed, self.tp_seed = state["default_seed"], state["tp_seed"]
        self._cpu_state = state["cpu"].clone()
        if self._cuda_state is not None and state.get("cuda") is not None:
            self._cuda_state = state["cuda"].clone()


def get_rng_state(tracker: RNGTracker | None = None) -> dict:
    """The whole process's RNG state: python, numpy, torch CPU, CUDA (all devices), tracker."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
             "numpy": None, "tracker": None if tracker is None else tracker.state_dict()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict, tracker: RNGTracker | None = None) -> None:
    """Restore what `get_rng_state` returned (CUDA only when present here and there)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("numpy") is not None:
        import numpy as np
        np.random.set_state(state["numpy"])
    if tracker is not None and state.get("tracker") is not None:
        tracker.load_state_dict(state["tracker"])
