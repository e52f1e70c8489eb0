"""SequenceParallelTrainer(sp_size=0 / cp_size=0) is refused like -1 (one sentence, before the
Trainer is built): `sp_size or 1` trained silently without sequence parallelism."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("transformers")

from megatron_sp.errors import ConfigError  # noqa: E402


@pytest.mark.parametrize("name, size", [("sp_size", 0), ("cp_size", 0), ("sp_size", -1),
                                        ("cp_size", 2.0), ("sp_size", True)])
def test_non_positive_sizes_refused_before_the_trainer_is_built(monkeypatch, name, size):
    from megatron_sp.hf import SequenceParallelTrainer
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)    # the trainer installs its hook
    with pytest.raises(ConfigError) as info:
        SequenceParallelTrainer(model=None, args=None, **{name: size})
    kind = "sequence" if name == "sp_size" else "context"
    assert str(info.value) == (f"SequenceParallelTrainer: {name}={size!r} is not a positive "
                               f"integer; pass {name}=N with N >= 1 (1, or leaving it out, for no "
                               f"{kind} parallelism).")


def test_sizes_that_are_fine():
    from megatron_sp.hf.trainer import _check_sizes
    for sp, cp in ((None, None), (1, 1), (4, 2), (None, 2)):
        _check_sizes(sp, cp)       # raises nothing
