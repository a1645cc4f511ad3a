"""Command-line flags generated from frozen settings dataclasses, and the way back: settings to a child's argv.

A settings field becomes an option through its metadata:

- `field(default=..., metadata=flag("--name", "help", ...))`: one option. Its default is the field's (a default
  factory is called when the parser is built, a field without a default is a required option); its parser is
  `parse`, else the type of the default (int, float, str, Path). A bool field is `--name/--no-name`. A tuple field
  takes one flag per item (`repeat`) or several values after one flag (`count`). Fields of one `exclusive` group
  are mutually exclusive options, and an argv names them only where they differ from their default. `off` names a
  second flag that sets an optional value to None (`--no-http`).
- `field(default_factory=X, metadata=nested())`: X's options join the same parser, flat. Flag names are global, so
  KVCacheSettings's --kv-blocks is one option wherever the cache sits.
- `field(default=None, metadata=optional(X, switch))`: settings that exist only when `switch` is on: either a flag
  of its own, which the parser gets here (`--hybrid-ngram`), or "FLAG VALUE", a value of a flag the command adds
  itself (`--draft ngram`). X's options parse as None ("not given") and then take the defaults this field's X has
  (HybridSettings holds NgramSettings(4, 3)); given while no switch that takes them is on, they are refused. An
  option reached twice through the same field (NgramSettings under --draft ngram and under --hybrid-ngram) is added
  once and serves whichever switch is on; the settings that hold both refuse both on at once.
- `field(default=Other.name, metadata=flag_of(Other, "name"))`: the same option as Other's field, stated once (the
  serve command's --mtp-mode is the draft's).
- A field without metadata is no option: the command fills it (resolved devices, secrets, transport security,
  addresses that a launcher picks), and an argv leaves it out.

`add_options(parser, Settings)` adds the options; `settings_of(Settings, args, **given)` builds the settings from
the parsed flags (`given`: the fields the command fills); `arguments_of(settings)` is an argv that parses back into
the same settings, args -> settings -> argv -> args, and `field_arguments(Settings, name=value)` the flags of a few
fields. The parsers here (`positive`, `thread_count`, ...) raise argparse's error with a message naming the value.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar, cast

T = TypeVar("T")
FLAG = "tandem.flag"  # metadata key of an option
NESTED = "tandem.nested"  # metadata key of nested settings


@dataclass(frozen=True)
class Flag:
    name: str  # "--kv-blocks"
    help: str
    parse: Callable[[str], Any] | None = None  # None: the type of the default
    choices: tuple[str, ...] | None = None
    metavar: str | tuple[str, ...] | None = None
    repeat: bool = False  # a tuple: the flag once per item
    count: int | str | None = None  # a tuple: this many values (or "+") after the flag
    exclusive: str | None = None  # the mutually exclusive group it belongs to
    off: str | None = None  # a flag that sets the field to None
    off_help: str = ""

    @property
    def dest(self) -> str:
        return dest_of(self.name)


@dataclass(frozen=True)
class Nested:
    settings: type[Any] | None = None  # an optional field's settings class; None: the default's class
    switch: str | None = None  # "--flag" or "--flag value"; None: always there
    help: str = ""  # of a switch flag added here


def flag(
    name: str,
    help: str,
    *,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | tuple[str, ...] | None = None,
    repeat: bool = False,
    count: int | str | None = None,
    exclusive: str | None = None,
    off: str | None = None,
    off_help: str = "",
) -> dict[str, Flag]:
    """The metadata of a field that is one option."""
    return {FLAG: Flag(name, help, parse, choices, metavar, repeat, count, exclusive, off, off_help)}


def nested() -> dict[str, Nested]:
    """The metadata of a field holding settings whose options join its own."""
    return {NESTED: Nested()}


def optional(settings: type[Any], switch: str, help: str = "") -> dict[str, Nested]:
    """The metadata of a field holding `settings` when `switch` is on, else None."""
    return {NESTED: Nested(settings, switch, help)}


def flag_of(settings: type[Any], name: str) -> Mapping[str, Any]:
    """The metadata of `settings`'s field `name`, for a field of other settings that is the same option (its default
    then refers to that field's: `field(default=Other.name, metadata=flag_of(Other, "name"))`)."""
    return _field(settings, name).metadata


def dest_of(name: str) -> str:
    """The attribute argparse stores a flag's value under: --kv-blocks -> kv_blocks."""
    return name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class _Option:
    """An option where the walk meets it: `switch` None when it is always there."""

    flag: Flag
    default: Any
    switch: str | None


@dataclass(frozen=True)
class _Group:
    """An optional field where the walk meets it (`name`: the field's, at the top level only)."""

    nested: Nested
    name: str | None


def _field(settings: type[Any], name: str) -> Field[Any]:
    return next(item for item in fields(settings) if item.name == name)


def _default_of(item: Field[Any], defaults: object | None) -> Any:
    """The default of a field: its value in `defaults`, the settings that the enclosing field's default made (one
    level: a nested field's default is always its own, so that settings which fill in fields on construction, such
    as a resolved tree shape, do not pass what they filled in for defaults of the flags)."""
    if defaults is not None and NESTED not in item.metadata:
        return getattr(defaults, item.name)
    if item.default is not MISSING:
        return item.default
    if item.default_factory is not MISSING:
        return item.default_factory()
    return MISSING


def _walk(settings: type[Any], defaults: object | None, switch: str | None) -> Iterator[_Option | _Group]:
    for item in fields(settings):
        if FLAG in item.metadata:
            yield _Option(item.metadata[FLAG], _default_of(item, defaults), switch)
        elif NESTED in item.metadata:
            group: Nested = item.metadata[NESTED]
            if group.switch is None:
                inner = _default_of(item, defaults)
                yield from _walk(type(inner), inner, switch)
            else:
                assert group.settings is not None
                yield _Group(group, item.name if defaults is None and switch is None else None)
                yield from _walk(group.settings, group.settings(), group.switch)


def add_options(parser: argparse.ArgumentParser, settings: type[Any]) -> None:
    """Adds the options of `settings` (see the module docstring) to `parser`."""
    found: dict[int, list[_Option]] = {}  # by the identity of the Flag: one option however often it is reached
    order: list[_Option | _Group] = []
    for entry in _walk(settings, None, None):
        if isinstance(entry, _Group):
            order.append(entry)
        elif id(entry.flag) in found:
            found[id(entry.flag)].append(entry)
        else:
            found[id(entry.flag)] = [entry]
            order.append(entry)
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for entry in order:
        if isinstance(entry, _Option):
            _add_option(parser, found[id(entry.flag)], exclusive)
        elif " " not in (switch := entry.nested.switch or ""):
            parser.add_argument(switch, action="store_true", help=entry.nested.help)


def _add_option(
    parser: argparse.ArgumentParser, where: list[_Option], exclusive: dict[str, argparse._MutuallyExclusiveGroup]
) -> None:
    option, own_default = where[0].flag, where[0].default
    default = own_default if where[0].switch is None else None  # options of optional settings: None, not given
    container: argparse._ActionsContainer = parser
    if option.exclusive is not None or option.off is not None:
        key = option.exclusive or option.name
        if key not in exclusive:
            exclusive[key] = parser.add_mutually_exclusive_group()
        container = exclusive[key]
    settings: dict[str, Any] = {"help": _help(option, where), "metavar": option.metavar, "nargs": option.count}
    if isinstance(own_default, bool):
        settings["action"] = argparse.BooleanOptionalAction
    else:
        settings.update(type=option.parse or _parser_of(own_default), choices=option.choices)
    if option.repeat:
        settings["action"] = "append"
        default = [] if default is MISSING else default  # no default: none given
    if default is MISSING:
        settings["required"] = True
    else:
        settings["default"] = list(default) if isinstance(default, tuple) else default
    container.add_argument(option.name, **{name: value for name, value in settings.items() if value is not None})
    if option.off is not None:
        container.add_argument(option.off, dest=option.dest, action="store_const", const=None, help=option.off_help)


def _help(option: Flag, where: list[_Option]) -> str:
    """The option's help, with its default(s): per switch for an option of optional settings."""
    text = option.help.replace("%", "%%")
    if where[0].switch is None:
        default = where[0].default
        if isinstance(default, bool):
            return f"{text} (default: {'on' if default else 'off'})"
        shown = default is not None and default is not MISSING and default != ()
        return f"{text} (default: %(default)s)" if shown else text
    defaults = ", ".join(f"{place.default} with {place.switch}" for place in where)
    return f"{text} (default: {defaults})"


def _parser_of(default: Any) -> Callable[[str], Any] | None:
    """The parser a field's default implies: its type (an item's, for a tuple); None for str and no default."""
    sample = default[0] if isinstance(default, (tuple, list)) and default else default
    if isinstance(sample, (int, float, Path)):
        return type(sample)
    return None


def _switched(switch: str, args: argparse.Namespace) -> bool:
    name, _, value = switch.partition(" ")
    given = getattr(args, dest_of(name), None)
    return given is True if not value else given == value


class FlagError(ValueError):
    """Options given that no switch on takes; the message names them and their switches."""


@dataclass(frozen=True)
class _Context:
    defaults: object | None  # the settings whose values are the defaults here; None: the class's
    fallback: bool  # inside optional settings: an option not given (None) takes the default
    on: Collection[str] = ()  # top-level optional fields built as if switched on


def settings_of(settings: type[T], args: argparse.Namespace, *, on: Collection[str] = (), **given: Any) -> T:
    """`settings` from the parsed flags. `given` fills (or overrides) top-level fields; the optional fields that `on`
    names are built as if their switch were on. Raises FlagError, or the ValueError of the settings' own checks."""
    _refuse_unswitched(settings, args, on)
    return cast(T, _build(settings, args, _Context(None, fallback=False, on=on), given))


def _build(settings: type[Any], args: argparse.Namespace, context: _Context, given: dict[str, Any]) -> Any:
    values = {}
    for item in fields(settings):
        if item.name in given:
            values[item.name] = given[item.name]
        elif FLAG in item.metadata:
            value = getattr(args, item.metadata[FLAG].dest)
            if value is None and context.fallback:
                value = getattr(context.defaults, item.name)
            values[item.name] = tuple(value) if isinstance(value, list) else value
        elif NESTED in item.metadata:
            values[item.name] = _build_nested(item, args, context)
        elif context.defaults is not None:
            values[item.name] = getattr(context.defaults, item.name)
    return settings(**values)


def _build_nested(item: Field[Any], args: argparse.Namespace, context: _Context) -> Any:
    group: Nested = item.metadata[NESTED]
    if group.switch is None:
        inner = _default_of(item, context.defaults)
        return _build(type(inner), args, _Context(inner, context.fallback), {})
    if item.name in context.on or _switched(group.switch, args):
        assert group.settings is not None
        return _build(group.settings, args, _Context(group.settings(), fallback=True), {})
    return None


def _refuse_unswitched(settings: type[Any], args: argparse.Namespace, on: Collection[str]) -> None:
    """Raises FlagError for options of optional settings given while no switch that takes them is on."""
    groups = [entry for entry in _walk(settings, None, None) if isinstance(entry, _Group)]
    active = {group.nested.switch for group in groups if group.name in on or _switched(group.nested.switch or "", args)}
    owners: dict[str, list[str]] = {}  # flag -> the switches that take it
    for entry in _walk(settings, None, None):
        if isinstance(entry, _Option) and entry.switch is not None:
            owners.setdefault(entry.flag.name, []).append(entry.switch)
    stray = [name for name, switches in owners.items() if getattr(args, dest_of(name)) is not None]
    stray = [name for name in stray if not active.intersection(owners[name])]
    if stray:
        switches = list(dict.fromkeys(switch for name in stray for switch in owners[name]))
        names = [name for name, taken_by in owners.items() if set(taken_by) & set(switches)]
        verb = "applies" if len(names) == 1 else "apply"
        raise FlagError(f"{_and(names)} {verb} to {_and(switches)} only")


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def arguments_of(settings: object) -> list[str]:
    """The flags that parse back into `settings` (the fields that are options; see the module docstring)."""
    arguments: list[str] = []
    for item in fields(cast(Any, settings)):
        arguments += _field_arguments(item, getattr(settings, item.name))
    return arguments


def field_arguments(settings: type[Any], **values: Any) -> list[str]:
    """The flags that give the named fields of `settings` these values (options, nested or optional settings)."""
    return [text for name, value in values.items() for text in _field_arguments(_field(settings, name), value)]


def _field_arguments(item: Field[Any], value: Any) -> list[str]:
    if FLAG in item.metadata:
        return _option_arguments(item.metadata[FLAG], value, _default_of(item, None))
    if NESTED not in item.metadata:
        return []
    group: Nested = item.metadata[NESTED]
    if value is None:
        return []
    switch = [] if group.switch is None else group.switch.split(" ")
    return [*switch, *arguments_of(value)]


def _option_arguments(option: Flag, value: Any, default: Any) -> list[str]:
    if option.exclusive is not None and value == default:
        return []  # the group takes one of its options: the others keep their defaults
    if isinstance(value, bool):
        return [option.name if value else f"--no-{option.name.removeprefix('--')}"]
    if value is None:
        if option.off is not None:
            return [option.off]
        if default not in (None, MISSING):
            raise ValueError(f"{option.name}: None cannot be given, and the default is {default!r}")
        return []
    if option.repeat:
        return [text for item in value for text in (option.name, str(item))]
    if option.count is not None:
        return [option.name, *(str(item) for item in value)] if len(value) else []
    return [option.name, str(value)]


# Parsers of option values: argparse prints an ArgumentTypeError's message after the flag.


def checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` whose ValueError argparse prints (it would print only "invalid value" for a plain ValueError)."""

    def parse_checked(text: str) -> T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse_checked.__name__ = parse.__name__
    return parse_checked


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: must be 0 or more")
    return value


def thread_count(text: str) -> int:
    count = int(text)
    if count < 0:
        raise argparse.ArgumentTypeError(f"{count}: a thread count is 0 (the default) or more")
    return count


def keepalive_seconds(text: str) -> float:
    value = float(text)
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"{text}: a keepalive timeout must be at least 1 second")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a number of seconds above 0")
    return value


def non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a number of seconds, 0 or more")
    return value
