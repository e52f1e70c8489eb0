"""What every section of the run's configuration shares: a field's flag, and setting a field of a
frozen section while it is being built (the section modules import them as _flag and _resolve)."""


def field_flag(name: str) -> str:
    """The command-line flag of a field: "train_iters" -> "--train-iters"."""
    return "--" + name.replace("_", "-")


def resolve_fields(section, **values) -> None:
    """Set fields while a frozen section is being built (__post_init__ only)."""
    for name, value in values.items():
        object.__setattr__(section, name, value)
