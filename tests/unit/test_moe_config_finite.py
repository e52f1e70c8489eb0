"""models.moe.MoEConfig (the library edge, without the command line) refuses inf like nan in the
router coefficients and factors: inf passed and surfaced as an OverflowError or a diverged loss."""
from __future__ import annotations

import pytest

from models.moe import MoEConfig


@pytest.mark.parametrize("field, flag, bound", [
    ("moe_aux_loss_coeff", "--moe-aux-loss-coeff", "must be >= 0 and finite"),
    ("moe_z_loss_coeff", "--moe-z-loss-coeff", "must be None or >= 0 and finite"),
    ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor",
     "must be None or > 0 and finite"),
    ("moe_expert_capacity_factor", "--moe-expert-capacity-factor",
     "must be None (no dropping) or > 0 and finite"),
])
def test_non_finite_refused(field, flag, bound):
    for value in (float("inf"), float("nan")):
        with pytest.raises(ValueError) as err:
            MoEConfig(num_experts=4, moe_ffn_hidden_size=8, **{field: value})
        assert str(err.value) == f"{field} ({flag}) {bound}, got {value!r}."
    MoEConfig(num_experts=4, moe_ffn_hidden_size=8, **{field: 1.0})      # a finite one is fine
