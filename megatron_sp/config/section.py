"""What every section of the run's configuration shares: a field's flag, and setting a field of a
frozen section while it is being built."""


def _flag(name: str) -> str:
    """The command-line flag of a field: "train_iters" -> "--train-iters"."""
    return "--" + name.replace("_", "-")


def _resolve(section, **values) -> None:
    """Set fields while a frozen section is being built (__post_init__ only)."""
    for name, value in values.items():
        object.__setattr__(section, name, value)
