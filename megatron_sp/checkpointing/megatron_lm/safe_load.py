"""Reading Megatron-LM's pickles without running their code (docs/checkpoints.md).

Megatron-LM saves with torch.save: `model_optim_rng.pt` (torch format), `common.pt` (torch_dist)
and the per-object byte entries of a DCP checkpoint are pickles. They are read here with
torch.load(weights_only=True) and a short allowlist of the types Megatron-LM stores besides
tensors and plain containers:

- argparse.Namespace (the run's arguments), types.SimpleNamespace, pathlib.PosixPath, io.BytesIO
  (Transformer Engine's `_extra_state`), signal.Signals (--exit-signal);
- NumPy's RNG state (numpy.ndarray rebuilt by numpy's `_reconstruct`, its dtypes);
- megatron-core's enums and records in the arguments and the rerun state (ModelType, AttnBackend,
  CudaGraphScope, RerunMode, RerunState, RerunDiagnostic, OptimizerConfig): stand-ins defined
  here that keep the stored value, so megatron-core need not be installed.

Anything else (a function, a class of another package) is refused in one sentence naming it.
"""
from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import signal
import types

import torch

from megatron_sp.checkpointing.format import CheckpointError


class MegatronValue:
    """A stand-in for one of megatron-core's enums: keeps the value pickle stored."""

    def __init__(self, *args, **kwargs):
        self.value = args[0] if len(args) == 1 else args

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __repr__(self):
        return f"{type(self).__name__}({self.value!r})"

    def __eq__(self, other):
        return isinstance(other, MegatronValue) and other.value == self.value

    def __hash__(self):
        return hash(repr(self.value))


class MegatronRecord:
    """A stand-in for one of megatron-core's dataclasses (its fields become attributes)."""

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


def _stand_in(name: str, base: type) -> tuple[type, str]:
    """(a class named like megatron-core's `name`, its full name in the pickle)."""
    return type(name.rsplit(".", 1)[1], (base,), {"__module__": __name__}), name


MEGATRON_TYPES = [_stand_in(n, MegatronValue) for n in (
    "megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunDiagnostic")] + [
    _stand_in(n, MegatronRecord) for n in ("megatron.core.rerun_state_machine.RerunState",
                                           "megatron.core.optimizer.OptimizerConfig",
                                           "megatron.core.optimizer.optimizer_config."
                                           "OptimizerConfig")]


def _numpy_types() -> list:
    import numpy as np
    out = [np.ndarray, np.dtype]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            mod = __import__(module, fromlist=["_reconstruct"])
        except ImportError:
            continue
        out.append((mod._reconstruct, f"{module}._reconstruct"))
    out += [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "uint8", "int32", "float32")]
    return out


def allowed_types() -> list:
    """The types a Megatron-LM pickle may name (module docstring)."""
    return ([argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, io.BytesIO,
             signal.Signals] + _numpy_types() + MEGATRON_TYPES)


def _blocked(err: BaseException) -> str:
    """The type a weights-only refusal names ('GLOBAL os.system', 'builtins.eval', ...)."""
    text = str(err)
    for line in text.splitlines():
        line = line.strip()
        if "GLOBAL" in line or "Unsupported" in line:
            return line.rstrip(".")
    return (text.splitlines() or [type(err).__name__])[0][:160]


def safe_load(source, what: str):
    """torch.load(weights_only=True) of `source` (a path or bytes) with the Megatron-LM allowlist;
    `what` names it in the one-sentence refusals (a damaged file, a type outside the list)."""
    data = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    try:
        with torch.serialization.safe_globals(allowed_types()):
            return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only" in str(err).lower() or "GLOBAL" in str(err):
            raise CheckpointError(
                f"{what} is refused: its pickle asks for a type outside the allowlist of what "
                f"Megatron-LM stores ({_blocked(err)}); it is read with torch.load("
                f"weights_only=True) only, never by running pickled code.") from None
        raise CheckpointError(f"{what} cannot be read ({_blocked(err)}): it is truncated or "
                              f"damaged; copy it again.") from None
    except OSError as err:
        raise CheckpointError(f"{what} cannot be read ({err.strerror or err}); check its "
                              f"permissions and disk.") from None
    except (RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(f"{what} cannot be read ({type(err).__name__}: "
                              f"{_blocked(err)}): it is truncated or damaged; copy it again.") \
            from None


# DCP's .metadata (torch_dist) --------------------------------------------------------------------

_DCP_MODULE = "torch.distributed.checkpoint."


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler of a DCP .metadata file that resolves only DCP's own record classes,
    torch.Size, torch's dtypes and layouts, and OrderedDict (what the file holds)."""

    def find_class(self, module, name):
        if module.startswith(_DCP_MODULE):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        elif (module, name) in (("torch", "Size"), ("torch.serialization", "_get_layout"),
                                ("collections", "OrderedDict")):
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def read_dcp_metadata(folder: str):
    """The DCP Metadata of a torch_dist iteration folder, unpickled with `_MetadataUnpickler`."""
    import os
    path = os.path.join(folder, ".metadata")
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"checkpoint file {path} is refused: it names a type outside the "
                              f"records DCP stores ({err}); it is not read.") from None
    except OSError as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({err.strerror or err}); "
                              f"check its permissions and disk.") from None
    except Exception as err:   # EOFError, a truncated record
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(err).__name__}): it "
                              f"is truncated or damaged (a half-written save?); copy it again or "
                              f"load an earlier iteration.") from None
