"""The command line's reference, ``docs/cli.md``, rendered from the parser itself: every command and
subcommand, its help, and each of its arguments with its default.

``python -m kinfer.ops.cli.reference > docs/cli.md`` writes it; a unit test fails when the file and
the parser disagree.
"""

from __future__ import annotations

import argparse

from kinfer.ops.cli import build_parser

REGENERATE = "python -m kinfer.ops.cli.reference > docs/cli.md"


def render() -> str:
    parser = build_parser()
    lines = [
        "# The `kinfer` command line",
        "",
        f"<!-- Rendered from the parser by `{REGENERATE}`; edit the commands (ops/cli/), not this file. -->",
        "",
        f"{parser.description}. Every command takes `-h` / `--help`; `python -m kinfer.ops.cli` is the same "
        "command.",
        "",
        "Options before the command:",
        "",
        *_arguments(parser),
        "",
        "Commands:",
        "",
    ]
    lines += _commands(parser, "kinfer", 2)
    return "\n".join(lines).rstrip("\n") + "\n"


def _commands(parser: argparse.ArgumentParser, prog: str, level: int) -> list[str]:
    """The index of ``parser``'s subcommands, then a section for each."""
    subs = _subparsers(parser)
    if subs is None:
        return []
    helps = {action.dest: action.help or "" for action in subs._choices_actions}
    lines = [f"- [`{prog} {name}`](#{_anchor(f'{prog} {name}')}): {helps[name]}" for name in subs.choices]
    lines.append("")
    for name, child in subs.choices.items():
        path = f"{prog} {name}"
        lines += [f"{'#' * level} `{path}`", "", f"{helps[name]}.", ""]
        arguments = _arguments(child)
        lines += [*arguments, ""] if arguments else []
        if child.epilog:
            lines += [f"{child.epilog}.", ""]
        lines += _commands(child, path, level + 1)
    return lines


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser] | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _anchor(heading: str) -> str:
    """The fragment GitHub gives a ``## `heading` `` title."""
    return heading.lower().replace(" ", "-")


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    """One line per argument (``--help`` and the subcommands aside): how it is written, then what it does."""
    lines = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        notes = []
        if action.choices is not None:
            notes.append("one of " + ", ".join(f"`{choice}`" for choice in action.choices))
        if action.option_strings and action.required:
            notes.append("required")
        if isinstance(action, argparse._AppendAction) and "repeat" not in (action.help or ""):
            notes.append("repeatable")
        text = "; ".join(filter(None, [_help(parser, action), *notes]))
        lines.append(f"- {_written(action)}" + (f": {text}" if text else ""))
    return lines


def _written(action: argparse.Action) -> str:
    """How the argument is written on the command line, e.g. ``--plot [PNG]``, ``text ...``."""
    if not action.option_strings:
        name = str(action.metavar or action.dest)
        return f"`{name} ...`" if action.nargs in ("+", "*", argparse.REMAINDER) else f"`{name}`"
    flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
    if action.nargs == 0:
        return flags
    value = str(action.metavar or action.dest.upper())
    if action.nargs == "?":
        value = f"[{value}]"
    return f"{flags} `{value}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help as ``--help`` shows it: ``%(default)s`` and the like filled in."""
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    params = {**vars(action), "prog": parser.prog}
    for name, value in list(params.items()):
        if hasattr(value, "__name__"):
            params[name] = value.__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(choice) for choice in params["choices"])
    return str(action.help % params)


if __name__ == "__main__":
    print(render(), end="")
