"""Checks of the parsed command line that no one flag's section can make (docs/design.md §12).

- Every float flag is finite: argparse's float() takes "inf" and "nan", which no flag of ours
  means (a limit that is not wanted is a flag left out), and which otherwise surface mid-run
  (an OverflowError at step 1, "lower --lr" at iteration 1). One sweep over the parser's float
  actions, so a flag added later is covered too.
- --offload-pool-gb within this host's memory, and a note when it does nothing (no
  --offload-activations, no CUDA device: the exact pool is pinned host memory for CUDA only).
"""
from __future__ import annotations

import argparse
import math
import os

from megatron_sp.errors import ConfigError


def float_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's actions that parse floats."""
    return [a for a in parser._actions if a.type is float and a.option_strings]


def refuse_non_finite(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """ConfigError naming the first float flag given as inf or nan."""
    for action in float_flags(parser):
        value = getattr(args, action.dest, None)
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                flag = max(action.option_strings, key=len)
                raise ConfigError(f"{flag} must be a finite number, got {v:g}; give a finite "
                                  f"value (or leave the flag out for its default).")


def host_memory_gib() -> float | None:
    """This host's physical memory in GiB (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def offload_pool_notes(args: argparse.Namespace, cuda: bool | None = None) -> list[str]:
    """Refuse an --offload-pool-gb over this host's memory; notes where it does nothing."""
    gb = getattr(args, "offload_pool_gb", None)
    if gb is None:
        return []
    host = host_memory_gib()
    if host is not None and gb > host:
        raise ConfigError(f"--offload-pool-gb {gb:g} is more than this host's memory "
                          f"({host:.1f} GiB): give a size that fits, or leave the flag out for "
                          f"the planner's count.")
    if not getattr(args, "offload_activations", False):
        return [f"--offload-pool-gb {gb:g} does nothing without --offload-activations (it sizes "
                f"the pinned host pool of the offloaded activations)."]
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    if not cuda:
        return [f"--offload-pool-gb {gb:g} does nothing on this host: the exact pinned pool is "
                f"for CUDA devices, and there is none."]
    return []
