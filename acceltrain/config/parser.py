"""The command line and YAML presets into a typed config: every field of a config class is a kebab-case flag
(``batch_size`` -> ``--batch-size``) and a preset key; precedence: dataclass default < ``--config`` preset < explicit
flag. Bad input is one line naming the flag or key and what is allowed, before anything heavy runs."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from acceltrain.config.options import ConfigError, Options, check_option_groups, flag_name, read_small_file, shorten

PRESETS = Path(__file__).parent.parent / "recipes" / "configs"  # the presets shipped with the package (--config NAME)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``int | None`` -> (int, True); ``int`` -> (int, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _field_kind(cls: type, field: dataclasses.Field) -> tuple[Any, tuple[str, ...] | None, bool, bool, dict]:
    """(base type, allowed choices, optional, list-like, aliases) of a config field, from its annotation and
    metadata. A list-like field (``list_like=True``: comma-separated values) also takes a YAML list."""
    hints = typing.get_type_hints(cls)
    base, optional = _unwrap_optional(hints[field.name])
    choices = field.metadata.get("choices")
    if typing.get_origin(base) is Literal:
        choices = tuple(typing.get_args(base))
        base = type(choices[0])
    return (
        base,
        (tuple(choices) if choices else None),
        optional,
        bool(field.metadata.get("list_like")),
        field.metadata.get("aliases", {}),
    )


def _convert(
    name: str,
    raw: Any,
    base: Any,
    choices: tuple | None,
    optional: bool,
    list_like: bool = False,
    aliases: dict | None = None,
) -> Any:
    """Coerce one value (a CLI string or a YAML scalar) to the field's type, or raise ConfigError."""
    if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null") and optional):
        if optional:
            return None
        raise ConfigError(f"--{flag_name(name)} must not be empty")
    if isinstance(raw, (list, tuple, dict)):  # from YAML
        if list_like and isinstance(raw, (list, tuple)) and all(isinstance(item, (str, int, float)) for item in raw):
            raw = ",".join(str(item) for item in raw)
        else:
            kind = {bool: "true or false", int: "integer", float: "number"}.get(base, "string")
            raise ConfigError(
                f"--{flag_name(name)} {shorten(raw)} is invalid: must be one {kind}, not a {type(raw).__name__}"
            )
    try:
        if base is bool:
            if isinstance(raw, bool):
                value = raw
            elif str(raw).lower() in ("1", "true", "yes", "on"):
                value = True
            elif str(raw).lower() in ("0", "false", "no", "off"):
                value = False
            else:
                raise ValueError
        elif base is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            value = int(raw) if not isinstance(raw, str) else int(raw, 10)
        elif base is float:
            if isinstance(raw, bool):
                raise ValueError
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError
        else:
            value = str(raw)
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a finite number"}.get(base, "a string")
        raise ConfigError(f"--{flag_name(name)} {shorten(raw)} is invalid: must be {kind}") from None
    value = (aliases or {}).get(value, value)
    if choices is not None and value not in choices:
        allowed = ", ".join(str(c) for c in choices)
        raise ConfigError(f"--{flag_name(name)} {shorten(value)} is invalid: choose one of {allowed}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line (exit 2), like every other config error."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def command_parser(prog: str, description: str) -> OneLineParser:
    """An ``acceltrain`` command's parser: its module docstring as the help, bad flags as one line, no abbreviated
    flags (``--trial`` is a typo, not ``--trials``)."""
    return OneLineParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )


def _help_with_default(field: dataclasses.Field) -> str:
    """The field's help, ending with its default unless the help states it already (a help saying what
    an unset value means beats "None"); an unset default reads "unset", a boolean "on" or "off"."""
    text = field.metadata.get("help", "")
    if "default:" in text:
        return text
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default
    if default is None:
        shown = "unset"
    elif isinstance(default, bool):
        shown = "on" if default else "off"
    else:
        shown = str(default).replace("%", "%%")  # argparse %-formats help texts
    return f"{text} (default: {shown})"


def build_parser(
    cls: type[Options], description: str | None = None, prog: str | None = None
) -> argparse.ArgumentParser:
    check_option_groups(cls)  # --help too: a clashing group would document the wrong flag
    parser = OneLineParser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --max-step is a typo, not --max-steps
    )
    for field in dataclasses.fields(cls):
        base, choices, *_ = _field_kind(cls, field)
        flag = f"--{flag_name(field.name)}"
        help_text = _help_with_default(field)
        if field.metadata.get("positional"):  # a command's operand (acceltrain predict RUN_FOLDER FILE)
            parser.add_argument(field.name, metavar=field.name.upper(), help=field.metadata.get("help", ""))
        elif base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices else base.__name__.upper()
            parser.add_argument(flag, metavar=metavar, help=help_text)
    return parser


def with_suggestion(token: str, known: list[str], quote: bool = False) -> str:
    """``token``, followed by the closest known name when there is one (a typo's likely meaning)."""
    shown = shorten(token) if quote else token
    if not quote and not token.startswith("--"):
        return shown
    close = difflib.get_close_matches(token, known, n=1)
    return (
        f"{shown} (did you mean {close[0]!r}?)"
        if close and quote
        else f"{shown} (did you mean {close[0]}?)"
        if close
        else shown
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice is an error instead of the last one silently winning."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shorten(key)}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


MAX_PRESET_VALUES = 10_000  # a preset is a flat mapping of option: value, with a few short lists


def _fits(data: Any, limit: int) -> bool:
    """Whether ``data`` holds at most ``limit`` values, each alias counted at every place it is used. YAML aliases
    share one object per anchor, so a 400-byte file loads small but its repr (or a full walk) is exponential:
    this walk stops at the limit, and ends on a list that holds itself."""
    pending, counted = [data], 1
    while pending:
        item = pending.pop()
        children = (
            [*item.keys(), *item.values()]
            if isinstance(item, dict)
            else item
            if isinstance(item, (list, tuple))
            else ()
        )
        counted += len(children)
        if counted > limit:
            return False
        pending.extend(children)
    return True


def load_yaml_preset(path: str) -> dict[str, Any]:
    """``--config``: a YAML file, or the name of a preset shipped with the package (``cifar10_fast``,
    ``cifar10_fast.yaml``), so that presets need no checkout."""
    if not Path(path).exists() and Path(path).name == path:  # a bare name: a preset shipped with the package
        shipped = PRESETS / f"{path.removesuffix('.yaml')}.yaml"
        if not shipped.is_file():
            names = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
            raise ConfigError(
                f"--config {shorten(path)} is neither a file nor a shipped preset: give a YAML file or one of {names}"
            )
        path = str(shipped)
    text = read_small_file(path, "--config")
    shown = f"--config {shorten(path, 200)}"
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        first = " ".join(line.strip() for line in str(err).splitlines()[:2] if line.strip())
        raise ConfigError(f"{shown} is not valid YAML: {first[:300]}") from None
    except RecursionError:  # PyYAML composes nested lists recursively
        raise ConfigError(f"{shown} is nested too deeply: a preset is a mapping of option: value") from None
    if not _fits(data, MAX_PRESET_VALUES):
        raise ConfigError(
            f"{shown} holds more than {MAX_PRESET_VALUES:,} keys and values (an alias counts each time it is "
            "used): a preset is a mapping of option: value"
        )
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{shown} must be a mapping of option: value, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


SHOWN_KEYS = 10  # unknown preset keys named in the one line


def parse_config(
    cls: type[Options], argv: list[str] | None = None, description: str | None = None, prog: str | None = None
):
    """Build a validated ``cls`` from defaults, an optional YAML preset and the command line (``prog``: the command's
    name in ``--help``, default the script's)."""
    parser = build_parser(cls, description, prog)
    parsed, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if unknown:
        flags = [f"--{flag_name(f.name)}" for f in dataclasses.fields(cls)]
        raise ConfigError("unrecognized arguments: " + " ".join(with_suggestion(token, flags) for token in unknown))
    given = vars(parsed)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    preset_path = given.get("config")
    if preset_path is not None:
        preset = load_yaml_preset(preset_path)
        unknown_keys = [key for key in preset if key not in fields or key == "config"]
        if unknown_keys:
            shown = ", ".join(
                with_suggestion(key, [f for f in fields if f != "config"], quote=True)
                for key in unknown_keys[:SHOWN_KEYS]
            )
            more = f" and {len(unknown_keys) - SHOWN_KEYS} more" if len(unknown_keys) > SHOWN_KEYS else ""
            raise ConfigError(
                f"--config {shorten(preset_path, 200)}: unknown key{'s' if len(unknown_keys) > 1 else ''} {shown}{more}"
            )
        for key, raw in preset.items():
            values[key] = _convert(key, raw, *_field_kind(cls, fields[key]))
    for key, raw in given.items():
        values[key] = raw if key == "config" else _convert(key, raw, *_field_kind(cls, fields[key]))
    cfg = cls(**values)
    cfg.validate()
    return cfg
