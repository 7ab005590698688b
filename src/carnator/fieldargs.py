"""Command-line options made from the fields of config dataclasses: one source for a setting's flag, default and help.

A field becomes an option when its metadata has a help text (:func:`opt` writes that metadata)::

    @dataclass
    class ServeConfig:
        port: int = field(default=8000, metadata=opt("port (0: any free port)", range=(0, 65535)))

    add_fields(parser, ServeConfig)                  # --port PORT, type, range, default 8000, help
    ServeConfig(**field_values(ServeConfig, parser.parse_args()))

From the field: the flag (``--`` and its name with dashes; ``flag=`` overrides), the default (the field's; ``show=``
writes it as it is typed on a command line), the type and choices (from the annotation: ``int``, ``float``, ``str``,
``bool`` as a switch, ``bool | None`` as ``--x/--no-x``, ``Literal[...]`` as choices; ``X | None`` as ``X``), and
the help (the field's, with ``(default: ...)`` added unless it already says what the default is). A value is parsed
by ``parse=`` (a function of the text that raises ValueError, or CarnatorError, saying what it expected) or checked
against ``range=(lo, hi)``; argparse reports a bad one as ``argument --flag: <that message>``. The option's ``dest``
is the field's name. Stdlib only: building a parser imports nothing heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["add_fields", "field_values", "float_in", "int_in", "opt", "parser_of"]

_NONE = type(None)


def opt(help: str | Callable[[], str], *, flag: str | None = None, metavar: str | None = None,
        parse: Callable[[str], Any] | None = None, show: Callable[[Any], str] | None = None,
        choices: Sequence[Any] | None = None, range: tuple[float, float] | None = None,
        append: bool = False) -> dict[str, Any]:
    """A field's metadata that makes it a command-line option (see the module's text). ``help``: the option's help
    (a zero-argument callable: computed when shown); ``append``: a repeatable option, its values a list."""
    meta: dict[str, Any] = {"help": help, "flag": flag, "metavar": metavar, "parse": parse, "show": show,
                            "choices": tuple(choices) if choices is not None else None, "range": range, "append": append}
    return {k: v for k, v in meta.items() if v is not None and v is not False}


def parser_of(parse: Callable[[str], Any], name: str | None = None) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ValueError or CarnatorError becomes argparse's one-line error."""
    from .errors import CarnatorError

    def typed(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, CarnatorError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    typed.__name__ = name or str(getattr(parse, "__name__", "value"))
    return typed


def _number_in(convert: Callable[[str], Any], word: str, lo: Any, hi: Any, show_value: bool) -> Callable[[str], Any]:
    """An argparse type: ``convert(text)`` within [lo, hi], else one line naming the range."""
    span = f"[{lo:g}, {hi:g}]" if isinstance(lo, float) else f"[{lo}, {hi}]"

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {word} in {span}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {word} in {span}, got {value if show_value else repr(text)}")
        return value

    parse.__name__ = word.split()[-1]
    return parse


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi]."""
    return _number_in(int, "an integer", lo, hi, show_value=True)


def float_in(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse type: a number in [lo, hi]."""
    return _number_in(float, "a number", float(lo), float(hi), show_value=False)


def _base(hint: Any) -> tuple[Any, bool]:
    """The annotation without ``| None``, and whether None was allowed."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not _NONE]
        return (args[0] if len(args) == 1 else hint), len(args) < len(typing.get_args(hint))
    return hint, False


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _with_default(help: str | Callable[[], str], shown: bool) -> str | Callable[[], str]:
    """The help, with ``(default: ...)`` added where it says nothing of the default and there is one to show."""
    def add(text: str) -> str:
        return text if not shown or "default" in text.lower() else f"{text} (default: %(default)s)"

    if callable(help):
        return lambda: add(help())
    return add(help)


def _argument(name: str, hint: Any, default: Any, meta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    base, optional = _base(hint)
    kw: dict[str, Any] = {"dest": name, "default": default}
    flag = meta.get("flag") or name.replace("_", "-")
    choices = meta.get("choices")
    if choices is None and typing.get_origin(base) is typing.Literal:
        choices = typing.get_args(base)
        base = type(choices[0])
    if meta.get("append"):
        kw.update(action="append", default=list(default or []))
        if meta.get("parse"):
            kw["type"] = parser_of(meta["parse"], name)
    elif base is bool and meta.get("parse") is None:
        if optional or default:  # --x / --no-x (argparse adds its default to the help when there is one)
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["action"] = "store_true"
    elif meta.get("parse"):
        kw["type"] = parser_of(meta["parse"], name)
        if default is not None and meta.get("show"):
            kw["default"] = meta["show"](default)  # as typed; argparse parses a text default with the type
    elif meta.get("range"):
        lo, hi = meta["range"]
        kw["type"] = int_in(int(lo), int(hi)) if base is int else float_in(float(lo), float(hi))
    elif base in (int, float):
        kw["type"] = base
    if choices is not None:
        kw["choices"] = tuple(choices)
    takes_value = kw.get("action") in (None, "append")
    if takes_value and meta.get("metavar"):
        kw["metavar"] = meta["metavar"]
    elif takes_value and meta.get("flag") and choices is None:  # a renamed option's value is named after its flag
        kw["metavar"] = flag.upper().replace("-", "_")
    shown = kw.get("action") not in ("store_true", argparse.BooleanOptionalAction) and kw["default"] not in (None, [], "")
    kw["help"] = _with_default(meta["help"], shown)
    return "--" + flag, kw


def add_fields(parser: argparse.ArgumentParser | argparse._ArgumentGroup, config: type, names: Iterable[str] | None = None,
               **changes: dict[str, Any]) -> list[str]:
    """Add an option for each of ``names`` (default: every field of the dataclass ``config`` whose metadata has a
    help, in their order); ``changes``: per field name, metadata that replaces the field's here (e.g. another
    help for one command). Returns the fields added."""
    hints = typing.get_type_hints(config, include_extras=False)
    fields = {f.name: f for f in dataclasses.fields(config)}
    chosen = list(names) if names is not None else [n for n, f in fields.items() if "help" in f.metadata]
    for name in chosen:
        f = fields[name]
        meta = {**f.metadata, **changes.get(name, {})}
        if "help" not in meta:
            raise TypeError(f"{config.__name__}.{name} has no help: give its field metadata=opt(...)")
        flag, kw = _argument(name, hints[name], _default(f), meta)
        parser.add_argument(flag, **kw)
    return chosen


def field_values(config: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``config``'s fields that ``args`` holds (the options :func:`add_fields` added, each under its
    field's name)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(config) if hasattr(args, f.name)}
