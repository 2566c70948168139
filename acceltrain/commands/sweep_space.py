"""``acceltrain sweep``'s search space: each ``--param NAME=SPEC`` read, checked against the recipe's own flags (its
config class decides, as its ``--help`` does) before any trial, and turned into Optuna distributions and back into the
recipe's flags."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from acceltrain.config.options import ConfigError, flag_name, shorten

KINDS = ("loguniform", "uniform", "int", "choice")
SPEC_FORMS = "loguniform:LOW:HIGH, uniform:LOW:HIGH, int:LOW:HIGH or choice:A,B,C"
OWNED = ("output_dir", "resume", "overwrite")  # set by the sweep for each trial


@dataclasses.dataclass(frozen=True)
class Param:
    """One swept flag: ``name`` is the config field (``weight_decay``), ``spec`` as given after the ``=``."""

    name: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    choices: tuple[str, ...] = ()
    spec: str = ""

    @property
    def flag(self) -> str:
        return f"--{flag_name(self.name)}"

    def distribution(self):
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high))
        if self.kind == "choice":
            return CategoricalDistribution(list(self.choices))
        return FloatDistribution(float(self.low), float(self.high), log=self.kind == "loguniform")

    def sample_value(self):
        """A value inside the range for the probe launch: the middle (geometric on a log scale), or the first choice."""
        if self.kind == "choice":
            return self.choices[0]
        if self.kind == "int":
            return int(self.low)
        if self.kind == "loguniform":
            return math.sqrt(self.low * self.high)
        return (self.low + self.high) / 2


def parse_params(texts: list[str], config_class: type, recipe: str, recipe_args: list[str]) -> list[Param]:
    """Each ``--param`` into a :class:`Param`, or one line naming the bad value and what is allowed: an unknown flag,
    a bad SPEC, LOW >= HIGH, a kind the flag's type cannot take, a flag swept twice or also among the recipe's."""
    fields = {field.name: field for field in dataclasses.fields(config_class) if not field.metadata.get("positional")}
    params: list[Param] = []
    for text in texts:
        name, sep, spec = text.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or not name or not spec:
            raise ConfigError(f"--param {_shown(text)}: give NAME=SPEC, with SPEC one of {SPEC_FORMS}")
        if name not in fields:
            from acceltrain.config.parser import with_suggestion

            known = [f"--{flag_name(key)}" for key in fields]
            raise ConfigError(
                f"--param {_shown(text)}: {with_suggestion(f'--{flag_name(name)}', known)} is not a flag of recipe "
                f"{recipe} (its --help lists them)"
            )
        if name in OWNED:
            raise ConfigError(
                f"--param {_shown(text)}: --{flag_name(name)} is set by the sweep for each trial: sweep another flag"
            )
        if any(param.name == name for param in params):
            raise ConfigError(f"--param {_shown(text)}: --{flag_name(name)} is swept twice: give it once")
        flag = f"--{flag_name(name)}"
        if any(arg in (flag, f"--no-{flag_name(name)}") or arg.startswith(f"{flag}=") for arg in recipe_args):
            raise ConfigError(
                f"--param {_shown(text)}: {flag} is also among the recipe's flags: give it only once, swept or fixed"
            )
        params.append(_check_against_field(_parse_spec(name, spec, text), config_class, fields[name]))
    return params


def _parse_spec(name: str, spec: str, text: str) -> Param:
    kind, _, rest = spec.partition(":")
    where = f"--param {_shown(text)}"
    if kind not in KINDS:
        raise ConfigError(f"{where}: unknown kind {kind!r}; SPEC is one of {SPEC_FORMS}")
    if kind == "choice":
        choices = tuple(choice.strip() for choice in rest.split(","))
        if not rest or any(not choice for choice in choices):
            raise ConfigError(f"{where}: choice needs values separated by commas, as choice:A,B,C")
        if len(set(choices)) != len(choices):
            raise ConfigError(f"{where}: a choice is given twice: give each value once")
        return Param(name, kind, choices=choices, spec=spec)
    bounds = rest.split(":")
    if len(bounds) != 2:
        raise ConfigError(f"{where}: {kind} needs two bounds, as {kind}:LOW:HIGH")
    number = int if kind == "int" else float
    values = []
    for label, bound in zip(("LOW", "HIGH"), bounds, strict=True):
        try:
            value = number(bound)
        except ValueError:
            allowed = "an integer" if kind == "int" else "a number"
            raise ConfigError(f"{where}: {label} {bound!r} is not {allowed}") from None
        if not math.isfinite(value):
            raise ConfigError(f"{where}: {label} {bound!r} is not a finite number")
        values.append(value)
    low, high = values
    if low >= high:
        raise ConfigError(f"{where}: LOW {bound_text(low)} must be below HIGH {bound_text(high)}")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: LOW {bound_text(low)} must be > 0 on a log scale (or use uniform:LOW:HIGH)")
    return Param(name, kind, low, high, spec=spec)


def _shown(text: str) -> str:
    """A --param as given, cut for a one-line message."""
    return text if len(text) <= 80 else shorten(text)[1:-1]


def bound_text(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _check_against_field(param: Param, config_class: type, field: dataclasses.Field) -> Param:
    """The kind must suit the flag's type (a float range for an integer flag would fail every trial), and every
    value the range can give must be one the flag accepts: its bounds and choices are converted as a trial's
    would be, so that a choice the flag refuses is one line now."""
    from acceltrain.config.parser import _convert, _field_kind

    base, choices, optional, list_like, aliases = _field_kind(config_class, field)
    where = f"--param {param.name.replace('_', '-')}={param.spec}"
    if param.kind in ("loguniform", "uniform") and base is not float:
        raise ConfigError(f"{where}: {param.flag} takes {_kind_of(base)}: use {_form_for(base)}")
    if param.kind == "int" and base not in (int, float):
        raise ConfigError(f"{where}: {param.flag} takes {_kind_of(base)}: use {_form_for(base)}")
    values = param.choices if param.kind == "choice" else (param.low, param.high)
    for value in values:
        try:
            _convert(field.name, value, base, choices, optional, list_like, aliases)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
    return param


def _kind_of(base: Any) -> str:
    return {bool: "true or false", int: "integers", float: "numbers"}.get(base, "strings")


def _form_for(base: Any) -> str:
    return "int:LOW:HIGH or choice:A,B" if base is int else "choice:A,B,C"


def trial_flags(params: list[Param], values: dict[str, Any], config_class: type) -> list[str]:
    """The recipe's flags for one trial's ``values``: ``--lr 0.0123`` (a float's repr, read back exactly, so that a
    resumed trial's config equals its checkpoint's), a boolean as ``--flag`` / ``--no-flag``."""
    from acceltrain.config.parser import _field_kind

    fields = {field.name: field for field in dataclasses.fields(config_class)}
    flags = []
    for param in params:
        value = values[param.name]
        if _field_kind(config_class, fields[param.name])[0] is bool:
            true = str(value).lower() in ("1", "true", "yes", "on")
            flags.append(param.flag if true else f"--no-{flag_name(param.name)}")
        else:
            flags += [param.flag, repr(value) if isinstance(value, float) else str(value)]
    return flags


def check_with_recipe(params: list[Param], config_class: type, recipe_args: list[str]) -> None:
    """The recipe's own flags with each range's two ends, parsed and validated as a trial's will be: a bad fixed flag,
    or a bound the recipe refuses (--param momentum=uniform:0:1.5), is one line before any trial."""
    from acceltrain.config.parser import parse_config

    ends = [{p.name: p.sample_value() for p in params}]
    for param in params:
        if param.kind != "choice":
            for end in (param.low, param.high):
                ends.append({**ends[0], param.name: end})
        for choice in param.choices[1:]:
            ends.append({**ends[0], param.name: choice})
    for values in ends:
        try:
            parse_config(config_class, [*recipe_args, *trial_flags(params, values, config_class)])
        except ConfigError as err:
            changed = [p for p in params if values[p.name] != ends[0][p.name]]
            where = f"--param {changed[0].name.replace('_', '-')}={changed[0].spec}: " if changed else ""
            raise ConfigError(f"{where}{err}") from None
