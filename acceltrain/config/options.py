"""What a config is made of, free of torch and Accelerate so that a recipe's ``--help`` answers at once:
a field with its flag help (:func:`option`), the one-line error (:class:`ConfigError`, :func:`require`),
the group base (:class:`Options`), and the small readers every config needs (JSON, small files). The built-in
hooks' option groups are :mod:`acceltrain.config.groups`; :class:`acceltrain.TrainConfig` is the loop's own group
and those."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from typing import Any

__all__ = [
    "ConfigError",
    "Options",
    "check_option_groups",
    "first_line",
    "flag_name",
    "option",
    "file_kind",
    "parse_json",
    "read_small_file",
    "require",
    "shorten",
]


class ConfigError(ValueError):
    """Bad user input: reported as one line and exit code 2, before any training starts."""


def first_line(err: object, limit: int = 300) -> str:
    """An exception (or a reason) inside a one-line message: its OS reason or text, first line, at most
    ``limit`` characters; its type's name when it has no text."""
    text = str(getattr(err, "strerror", None) or err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


def shorten(value: object, limit: int = 80) -> str:
    """``repr(value)`` for a one-line message, cut to ``limit`` characters: a bad value may be megabytes
    (a YAML alias bomb, a pasted file), and echoing it whole is no longer one line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field with its CLI help text (and optional ``choices``). ``free_on_resume=True``: a
    setting that does not change the run's maths (speed, logging, outputs) and may differ on ``--resume``;
    ``list_like=True``: comma-separated values, also given as a YAML list; ``aliases={old: new}``: old
    names still accepted, stored as the new one; ``positional=True``: an operand of a command, not a flag."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


@dataclasses.dataclass
class Options:
    """A group of config fields and their checks, declared next to what they configure. Each group's
    :meth:`validate` checks its own fields and calls ``super().validate()`` first, so a config made of many
    groups checks them all."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` on the first bad value (the base: on groups that clash)."""
        check_option_groups(type(self))

    def resolved(self) -> dict[str, Any]:
        """The fields whose unset value stands for one worked out from other fields, with that value (``--lora-alpha``:
        2 x ``--lora-r``): the settings as the run used them, for a model card. Each group adds its own."""
        return {}

    def read_only(self):
        """This config, its fields unchangeable from now on (the run's ``run.cfg``: a hook that set ``run.cfg.lr``
        would train on the old value while train_config.yaml and the checkpoints record the new one). Returns it;
        ``dataclasses.replace`` still makes a changeable copy."""
        object.__setattr__(self, "_read_only", True)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_read_only"):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {name!r}: the run's config is read-only once training starts (settings change before "
                "fit(), or on --resume with --allow-config-change)"
            )
        super().__setattr__(name, value)


def check_option_groups(config_class: type) -> None:
    """Each field belongs to one option group. A group that declares a field of another group it does not extend
    (a hook's ``max_steps`` beside the loop's) would silently take over that flag, its help and its default; a
    subclass may redeclare its own bases' fields (a recipe's defaults)."""
    import inspect

    fields = {field.name for field in dataclasses.fields(config_class)}
    owners: dict[str, type] = {}
    for group in reversed(config_class.__mro__):  # bases first
        for name in inspect.get_annotations(group):
            owner = owners.get(name)
            if owner is not None and name in fields and not issubclass(group, owner):
                raise ConfigError(
                    f"option groups {owner.__name__} and {group.__name__} both declare {name} (--{flag_name(name)}): "
                    f"rename the field of {group.__name__}"
                )
            owners[name] = group


def require(ok: bool, name: str, value: Any, allowed: str) -> None:
    """Raise the standard one-line error for field ``name`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"--{flag_name(name)} {shorten(value)} is invalid: must be {allowed}")


def flag_name(field_name: str) -> str:
    return field_name.replace("_", "-")


MAX_FILE_BYTES = 1_000_000  # a preset or a DeepSpeed JSON is a few kilobytes at most

_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def file_kind(mode: int) -> str | None:
    """What an ``st_mode`` names when it is not a regular file ("a named pipe (FIFO)"), else None."""
    kind = stat.S_IFMT(mode)
    return None if kind == stat.S_IFREG else _FILE_KINDS.get(kind, "a special file")


def parse_json(text: str | bytes):
    """``json.loads``, with JSON nested too deeply for Python's decoder (``[`` repeated 200,000 times: a
    RecursionError) reported as the ValueError that any other malformed JSON raises."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def read_small_file(path: str, what: str, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of the regular file ``path`` of at most ``limit`` bytes, else a ConfigError that starts with
    ``what`` and the path. Opened without blocking and checked on the open descriptor: a FIFO would block the
    read for good, and /dev/zero never ends."""
    shown = f"{what} {shorten(path, 200)}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise ConfigError(f"{shown} cannot be read: {first_line(err)}") from None
    kind = file_kind(os.fstat(fd).st_mode)
    if kind:
        os.close(fd)
        raise ConfigError(f"{shown} is {kind}, not a regular file")
    with os.fdopen(fd, "rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ConfigError(f"{shown} is larger than {limit // 1_000_000} MB: not a config file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{shown} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})") from None
