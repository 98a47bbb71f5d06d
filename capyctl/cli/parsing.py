"""What ``capyctl``'s argument parsers share: the one-line-error parser, the argument
types, and how a cmd names its handler (imported only when it runs)."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NoReturn

from capyctl.deployments.settings_spec import MAX_PRICE
from hostagent.units import SizeError, is_bare_number, is_unit, parse_size


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit with status 2."""

    # The command line being parsed (its subcommands' parsers see it too).
    argv: ClassVar[list[str]] = []

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        Parser.argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(Parser.argv, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{split_size_hint(message)}\n")


def split_size_hint(message: str) -> str:
    """For ``--gpu-memory 16 GB``: the unit left over (or the number refused without it),
    and how to write the size."""
    argv = Parser.argv
    for number, word in itertools.pairwise(argv):
        if not (is_unit(word) and is_bare_number(number)):
            continue
        if message.startswith("unrecognized arguments:") or f"{number!r}" in message:
            return f" (a size is one word: write {number}{word}, not {number} {word})"
    return ""


def size_arg(text: str) -> int:
    try:
        return parse_size(text, unit_required=True)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def count_arg(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum}")
        return value

    return parse


def range_arg(minimum: int) -> Callable[[str], tuple[int, int]]:
    """``N`` or ``LOW:N``, each at least ``minimum``, LOW at most N: (LOW, N), LOW 0 where
    only N is given."""
    count = count_arg(minimum)

    def parse(text: str) -> tuple[int, int]:
        low_text, colon, high_text = text.partition(":")
        if not colon:
            return 0, count(text)
        low, high = count(low_text), count(high_text)
        if low > high:
            raise argparse.ArgumentTypeError(f"{text!r}: {low} is more than {high}")
        return low, high

    return parse


def price_arg(text: str) -> float:
    """An amount of money: a number from 0 to a million (``0.15``, ``2.5``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid amount {text!r}") from None
    if not 0 <= value <= MAX_PRICE:
        raise argparse.ArgumentTypeError(f"{text!r} must be from 0 to {MAX_PRICE:,}")
    return value


def limit_arg(text: str) -> int | None:
    """A count of at least 1, or ``none`` for no limit."""
    return None if text == "none" else count_arg(1)(text)


def lazy_handler(name: str) -> Callable[[argparse.Namespace], int]:
    """Resolve a handler lazily, so parsing never imports Django."""

    def call(args: argparse.Namespace) -> int:
        import importlib

        module = "commands"  # import only the module of the handler that runs
        if name == "start_host":  # the host agent: no Django (the slim install runs it)
            module = "agent"
        elif name.startswith("start"):
            module = "start"
        elif name.startswith(("key_", "user_", "team_", "budget_", "usage")):
            module = "people"
        elif name.startswith("trace_"):
            module = "traces"
        elif name.startswith("simulate"):
            module = "whatif"
        elif name in ("backup", "restore"):
            module = "backup"
        elif name.startswith("service_"):
            module = "service"
        elif name.startswith(("host_", "cache_")):
            module = "machines"
        elif name == "status":
            module = "status"
        handler: Any = getattr(importlib.import_module(f"capyctl.cli.{module}"), name)
        result: int = handler(args)
        return result

    return call


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def cmd(parent: Any, name: str, help_text: str, handler: str | None = None) -> Parser:
    parser: Parser = parent.add_parser(name, help=help_text, description=help_text)
    if handler:
        parser.set_defaults(handler=lazy_handler(handler))
    return parser
