"""Small helpers shared by the tensor-parallel modules: size checks with clear errors."""
from __future__ import annotations


def check_divisible(value: int, divisor: int, what: str, divisor_what: str | None = None) -> None:
    """Raise ValueError naming the numbers when `value` is not divisible by `divisor`.

    `what` names the quantity, e.g. "out_features of ColumnParallelLinear"; `divisor_what`
    optionally names the divisor, e.g. "chunks*tp = 2*4".
    """
    if divisor <= 0 or value % divisor != 0:
        by = f"{divisor_what} = {divisor}" if divisor_what else str(divisor)
        raise ValueError(f"{what} ({value}) is not divisible by {by}: choose sizes so that "
                         f"{value} % {divisor} == 0 (e.g. pad or change the tensor-parallel size).")


def divide(value: int, divisor: int, what: str, divisor_what: str | None = None) -> int:
    """value // divisor, after `check_divisible`."""
    check_divisible(value, divisor, what, divisor_what)
    return value // divisor
