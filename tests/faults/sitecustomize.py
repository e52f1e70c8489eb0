"""Test-only: fault injection in every Python process the tests start, under any launcher
(torchrun's workers, srun's tasks, a script run by hand): tests/conftest.py puts this folder first
on PYTHONPATH, and Python imports this module at start-up. Without MEGATRON_SP_INJECT_* it does
nothing; with them, megatron_sp.testing.install_faults() runs as soon as
megatron_sp.training.trainer has been imported (not before: torch is not imported here, and a
launcher's own process never builds a Trainer). The environment's own sitecustomize, if any, runs
afterwards (this one shadows it).
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

TRAINER = "megatron_sp.training.trainer"


class _InstallFaultsAfterTrainer(importlib.abc.MetaPathFinder):
    """Finds megatron_sp.training.trainer through the other finders, and has its loader run
    install_faults(trainer_module=...) right after the module executed."""

    def find_spec(self, name, path=None, target=None):
        if name != TRAINER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            from megatron_sp.testing import install_faults
            install_faults(trainer_module=module)
        spec.loader.exec_module = exec_module
        return spec


if any(k.startswith("MEGATRON_SP_INJECT_") for k in os.environ):
    sys.meta_path.insert(0, _InstallFaultsAfterTrainer())

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _spec is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
