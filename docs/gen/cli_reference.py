"""Renders docs/reference/cli.md from the argparse parsers (:func:`fullband.cli.build_parser`): every sub-command and
nested sub-command with its usage, description and every option (its help and default). Never edit cli.md by hand.

    python docs/gen/cli_reference.py            # (re)write docs/reference/cli.md
    python docs/gen/cli_reference.py --check    # exit 1 when the committed file differs from what it renders

The output does not depend on the terminal: usage lines are formatted at a fixed width (:data:`WIDTH`), and help
strings are taken from the parsers, not from a formatter that wraps them.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

WIDTH = 100  # columns of the usage lines
# before argparse reads the terminal: HelpFormatter takes its width from COLUMNS, colour from the environment
os.environ["COLUMNS"] = str(WIDTH)
os.environ["NO_COLOR"] = "1"
os.environ["PYTHON_COLORS"] = "0"

from fullband.cli import build_parser  # noqa: E402  (after COLUMNS is fixed)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.path.join(ROOT, "docs", "reference", "cli.md")
ROLE = re.compile(r":(?:mod|func|class|meth|data|attr|obj):`~?([^`]+)`")


class _Fixed(argparse.HelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, width=WIDTH, max_help_position=32)


def _text(s: str) -> str:
    """Help or description text as Markdown: Sphinx roles as code, ``<`` escaped, whitespace kept per line."""
    return ROLE.sub(r"`\1`", s).replace("<", "&lt;")


def _cell(s: str) -> str:
    return _text(" ".join(s.split())).replace("|", "\\|")


def _description(parser: argparse.ArgumentParser) -> list[str]:
    """The description's paragraphs (blank-line separated), each line stripped so none reads as a code block."""
    if not parser.description:
        return []
    out = []
    for para in re.split(r"\n\s*\n", parser.description.strip()):
        out += [_text(line.strip()) for line in para.strip().splitlines()] + [""]
    return out


def _help(action: argparse.Action) -> str:
    if not action.help:
        return ""
    params = dict(vars(action), prog="")
    for name, value in list(params.items()):
        if value is argparse.SUPPRESS:
            del params[name]
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    try:
        return action.help % params
    except (KeyError, TypeError, ValueError):
        return action.help


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
                           argparse._CountAction, argparse._HelpAction, argparse._VersionAction)):
        return ""
    if action.required:
        return "required"
    if action.default is None or action.default is argparse.SUPPRESS or action.default == []:
        return ""
    return "`" + str(action.default).replace("|", "\\|") + "`"


def _invocation(action: argparse.Action) -> str:
    fmt = _Fixed("fullband")
    return "`" + fmt._format_action_invocation(action).replace("|", "\\|") + "`"


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _render(parser: argparse.ArgumentParser, level: int) -> list[str]:
    usage = _Fixed(parser.prog)
    usage.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    lines = [f"{'#' * level} `{parser.prog}`", "", "```text", usage.format_help().strip(), "```", ""]
    lines += _description(parser)
    positionals = [a for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
                   and a.help is not argparse.SUPPRESS]
    options = [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]
    if positionals:
        lines += ["| argument | help |", "| --- | --- |"]
        lines += [f"| {_invocation(a)} | {_cell(_help(a))} |" for a in positionals] + [""]
    if options:
        lines += ["| option | default | help |", "| --- | --- | --- |"]
        lines += [f"| {_invocation(a)} | {_default(a)} | {_cell(_help(a))} |" for a in options] + [""]
    sub = _subparsers(parser)
    if sub is not None:
        helps = {a.dest: a.help or "" for a in sub._choices_actions}
        lines += ["| sub-command | what it does |", "| --- | --- |"]
        lines += [f"| [`{name}`](#{_anchor(child.prog)}) | {_cell(helps.get(name, ''))} |"
                  for name, child in sub.choices.items()] + [""]
        for child in sub.choices.values():
            lines += _render(child, min(level + 1, 6))
    return lines


def _anchor(prog: str) -> str:
    """The id Python-Markdown's toc gives a heading ```prog```: lower case, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", prog).strip().lower().replace(" ", "-")


def render() -> str:
    parser = build_parser()
    head = ["# CLI reference", "",
            "<!-- GENERATED by docs/gen/cli_reference.py from fullband.cli.build_parser(); do not edit by hand. -->",
            "", "Every `fullband` command, generated from its argparse parser (the same text as `--help`). Options "
            "without a default are flags or have none.", ""]
    return "\n".join(head + _render(parser, 2)).rstrip() + "\n"


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".cli-", suffix=".md")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/reference/cli.md is not what this renders")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = open(TARGET, encoding="utf-8").read() if os.path.exists(TARGET) else None
        if current != text:
            print(f"{os.path.relpath(TARGET, ROOT)} is out of date: run python docs/gen/cli_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    _write_atomic(TARGET, text)
    print(f"wrote {os.path.relpath(TARGET, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
