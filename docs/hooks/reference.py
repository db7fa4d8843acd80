"""MkDocs hook: the reference pages' tables, made at build time from the code that
defines them, so that they cannot drift from it.

A page line ``<!-- generated: WHAT -->`` is replaced by:

- ``cli multipy``, ``cli run``, ``cli serve``, ``cli shell``: a command's options, one
  table per argparse group, from its parser (multipy.cli.parsers, multipy.serve.command.parser,
  multipy.shell.parser);
- ``python-api``: a mkdocstrings block for each name that ``multipy`` exports
  (multipy.__all__), under the module that defines it;
- ``metrics``: the Prometheus metrics that ``GET /metrics`` gives, rendered by
  multipy.serve.request.metrics.Metrics for one model that has failed once (so that
  every label shows), and the statuses a failure is counted under;
- ``errors``: every status the server answers a request with but 200, when, and its gRPC
  code (multipy.serve.request.messages.ANSWERS, multipy.serve.rpc.server.CODES).

An unknown WHAT fails the build.
"""
from __future__ import annotations

import argparse
import re
from typing import Callable

_MARKER = re.compile(r"^<!-- generated: ([\w-]+(?: [\w-]+)?) -->$", re.MULTILINE)


def _cell(text: str) -> str:
    """text for a Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _usage(action: argparse.Action) -> str:
    """How an option is written: its strings and its value's name."""
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    value = ""
    if action.nargs != 0:
        value = " " + (action.metavar or action.dest.upper())
    return ", ".join(f"`{option}{value}`" for option in action.option_strings)


def _help(action: argparse.Action) -> str:
    """An option's help, with its choices and its default where the help does not say it."""
    text = action.help or ""
    if "%(" in text:  # argparse's own expansion of %(default)s and the like
        text %= vars(action)
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        text += f" (one of: {', '.join(map(str, action.choices))})"
    if isinstance(action, argparse._SubParsersAction):
        text = "; ".join(f"`{choice.dest}`: {choice.help}" for choice in action._choices_actions)
    return _cell(text)


def _options(parser: argparse.ArgumentParser) -> str:
    """The parser's usage, description and options, as Markdown: a table per group."""
    usage = parser.format_usage().removeprefix("usage: ").strip()
    parts = [f"```\n{usage}\n```", _cell(parser.description or "")]
    for group in parser._action_groups:
        actions = [action for action in group._group_actions
                   if action.help != argparse.SUPPRESS]
        if not actions:
            continue
        rows = "\n".join(f"| {_usage(action)} | {_help(action)} |" for action in actions)
        parts.append(f"**{group.title}**" + (f": {_cell(group.description)}"
                                              if group.description else "")
                     + f"\n\n| option | what it does |\n|---|---|\n{rows}")
    if parser.epilog:
        parts.append(_cell(parser.epilog))
    return "\n\n".join(parts)


def _cli(command: str) -> str:
    if command == "multipy" or command == "run":
        from multipy.cli import parsers

        main, run = parsers()
        return _options(main if command == "multipy" else run)
    if command == "serve":
        from multipy.serve.command import parser
        return _options(parser())
    if command == "shell":
        from multipy.shell import parser
        return _options(parser())
    raise ValueError(f"no command {command!r} to document")


def _python_api() -> str:
    import importlib

    import multipy

    blocks = []
    for name in multipy.__all__:
        module = getattr(multipy, name).__module__
        importlib.import_module(module)
        blocks.append(f"::: {module}.{name}\n    options:\n      heading_level: 2\n"
                      f"      show_root_full_path: false")
    return "\n\n".join(blocks)


def _metrics() -> str:
    from prometheus_client.parser import text_string_to_metric_families

    from multipy.serve.request.board import STATUSES
    from multipy.serve.request.metrics import Metrics

    metrics = Metrics(["MODEL"], 1)
    metrics.models["MODEL"].answered(500, 1)
    text, _ = metrics.render()
    rows = []
    for family in text_string_to_metric_families(text.decode()):
        labels = sorted({label for sample in family.samples for label in sample.labels
                         if label not in ("le",)})
        name = family.name + ("_total" if family.type == "counter" else "")
        rows.append(f"| `{name}` | {family.type} | {', '.join(labels)} | "
                    f"{_cell(family.documentation)} |")
    statuses = ", ".join(map(str, STATUSES))
    return ("| metric | type | labels | what it counts |\n|---|---|---|---|\n" + "\n".join(rows)
            + f"\n\nA failure's `status` label is one of {statuses}; another status counts "
              f"under its class's: a 4xx as 400, the rest as 500.")


def _errors() -> str:
    from multipy.serve.request.messages import ANSWERS
    from multipy.serve.rpc.server import CODES

    def code(status: int) -> str:
        return CODES[status].name if status in CODES else "– (HTTP only)"

    rows = "\n".join(f"| {status} | {code(status)} | {_cell(when)} |"
                     for status, when in sorted(ANSWERS.items()))
    return "| status | gRPC code | when |\n|---|---|---|\n" + rows


_GENERATORS: dict[str, Callable[[], str]] = {"python-api": _python_api, "metrics": _metrics,
                                             "errors": _errors}


def _generated(match: re.Match[str]) -> str:
    what = match.group(1)
    if what.startswith("cli "):
        return _cli(what.removeprefix("cli "))
    if what not in _GENERATORS:
        raise ValueError(f"docs: nothing generates {what!r}")
    return _GENERATORS[what]()


def on_page_markdown(markdown: str, **_: object) -> str:
    """The page, with each generated part in place of its marker."""
    return _MARKER.sub(_generated, markdown)
