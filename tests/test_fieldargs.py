"""Command-line options made from config dataclass fields (:mod:`carnator.fieldargs`), on a hand-made dataclass: the
flag, default, type, choices and help come from the field, a bad value is argparse's one line, and the parser's
values build the dataclass back."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import pytest

from carnator.cli import _Parser, _UsageError
from carnator.fieldargs import add_fields, field_values, opt


def _half(text: str) -> float:
    if text != "half":
        raise ValueError(f"expected 'half', got {text!r}")
    return 0.5


@dataclass
class Toy:
    name: str = field(default="toy", metadata=opt("what it is called"))
    count: int = field(default=3, metadata=opt("how many", range=(1, 9)))
    ratio: float = field(default=0.25, metadata=opt("a share (default: a quarter)"))
    colour: Literal["red", "blue"] = field(default="red", metadata=opt("its colour"))
    size: str = field(default="s", metadata=opt("its size", choices=("s", "m")))
    loud: bool = field(default=False, metadata=opt("make noise"))
    fast: bool | None = field(default=None, metadata=opt("go fast (default: when it can)"))
    limit: int | None = field(default=None, metadata=opt("at most this many", metavar="N"))
    share: float = field(default=0.5, metadata=opt("a half", flag="portion", parse=_half, show=lambda v: "half"))
    tags: list[str] = field(default_factory=list, metadata=opt("a tag (repeatable)", flag="tag", metavar="TAG", append=True))
    hidden: int = 7  # no help: not an option


def parser() -> _Parser:
    p = _Parser(prog="carnator toy")
    assert add_fields(p, Toy) == [f.name for f in dataclasses.fields(Toy) if f.name != "hidden"]
    return p


def test_defaults_are_the_fields_and_build_the_dataclass_back():
    args = parser().parse_args([])
    assert field_values(Toy, args) == {f.name: getattr(Toy(), f.name) for f in dataclasses.fields(Toy) if f.name != "hidden"}
    assert Toy(**field_values(Toy, args)) == Toy()


def test_flags_types_and_choices_come_from_the_fields():
    args = parser().parse_args(["--name", "x", "--count", "9", "--ratio", "1e-1", "--colour", "blue", "--size", "m",
                                "--loud", "--no-fast", "--limit", "12", "--portion", "half", "--tag", "a", "--tag", "b"])
    assert Toy(**field_values(Toy, args)) == Toy(name="x", count=9, ratio=0.1, colour="blue", size="m", loud=True,
                                                fast=False, limit=12, share=0.5, tags=["a", "b"])
    assert parser().parse_args(["--fast"]).fast is True
    assert parser().parse_args([]).tags == []  # a repeatable option's default list is not shared between parses


@pytest.mark.parametrize("argv, words", [
    (["--count", "10"], "argument --count: expected an integer in [1, 9], got 10"),
    (["--count", "two"], "argument --count: expected an integer in [1, 9], got 'two'"),
    (["--ratio", "much"], "argument --ratio: invalid float value: 'much'"),
    (["--colour", "green"], "argument --colour: invalid choice: 'green' (choose from 'red', 'blue')"),
    (["--size", "l"], "argument --size: invalid choice: 'l'"),
    (["--limit", "1.5"], "argument --limit: invalid int value: '1.5'"),
    (["--portion", "third"], "argument --portion: expected 'half', got 'third'"),
    (["--share", "half"], "unrecognized arguments: --share"),  # the flag override replaces the field's name
    (["--hidden", "1"], "unrecognized arguments: --hidden"),
])
def test_a_bad_value_is_one_usage_error(argv, words):
    with pytest.raises(_UsageError) as e:
        parser().parse_args(argv)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_bad_value_on_the_command_line_is_one_carnator_error_line(capsys):
    """Through ``carnator``'s own main: one line ``carnator: error: ...``, status 2, for an option made from a field."""
    from carnator.cli import main

    assert main(["serve", "--max-queue", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("carnator: error: argument --max-queue: expected an integer in [1, 1000000], got 0")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_help_is_the_fields_with_its_default():
    text = " ".join(parser().format_help().split())
    for part in ("--name NAME what it is called (default: toy)", "--count COUNT how many (default: 3)",
                 "--ratio RATIO a share (default: a quarter)",  # the help says its default: nothing added
                 "--colour {red,blue} its colour (default: red)", "--size {s,m} its size (default: s)",
                 "--loud make noise", "--fast, --no-fast go fast (default: when it can)", "--limit N at most this many",
                 "--portion PORTION a half (default: half)", "--tag TAG a tag (repeatable)"):
        assert part in text, part
    assert "--loud make noise (default" not in text and "--limit N at most this many (default" not in text
    assert "hidden" not in text


def test_changes_replace_a_fields_metadata_for_one_parser():
    p = _Parser(prog="carnator toy")
    add_fields(p, Toy, ["count"], count={"help": "how many here", "range": (2, 3)})
    assert "how many here (default: 3)" in " ".join(p.format_help().split())
    with pytest.raises(_UsageError, match=r"\[2, 3\], got 4"):
        p.parse_args(["--count", "4"])


def test_a_field_without_help_is_refused_by_name():
    with pytest.raises(TypeError, match="Toy.hidden has no help"):
        add_fields(_Parser(prog="carnator toy"), Toy, ["hidden"])


def test_a_renamed_switch_and_a_renamed_choice():
    @dataclass
    class Renamed:
        quiet_mode: bool = field(default=False, metadata=opt("say less", flag="hush"))
        shade: Literal["dark", "light"] = field(default="dark", metadata=opt("its shade", flag="tone"))

    p = _Parser(prog="carnator toy")
    add_fields(p, Renamed)
    text = " ".join(p.format_help().split())
    assert "--hush say less" in text and "--tone {dark,light} its shade (default: dark)" in text
    assert Renamed(**field_values(Renamed, p.parse_args(["--hush", "--tone", "light"]))) == Renamed(True, "light")
