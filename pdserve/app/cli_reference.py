"""Write docs/cli.md, the reference of every `pdserve` command's flags, from the parsers
themselves (so it cannot drift from `--help`):

    python -m pdserve.app.cli_reference > docs/cli.md

Commands that share a module (prefill, decode, colocated) share one section.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.app.cli import COMMANDS, make_parser

REGENERATE = "python -m pdserve.app.cli_reference > docs/cli.md"


def render() -> str:
    lines = ["# `pdserve` command-line reference", "",
             f"Generated from the commands' parsers (`{REGENERATE}`); "
             "`pdserve <command> --help` prints the same.", ""]
    by_module: dict[str, list[str]] = {}
    for name, (module_name, _) in COMMANDS.items():
        by_module.setdefault(module_name, []).append(name)
    lines += ["| command | what it does |", "|---|---|"]
    for names in by_module.values():
        lines.append(f"| [`{' | '.join(names)}`](#{_anchor(names)}) | "
                     f"{' / '.join(COMMANDS[n][1] for n in names)} |")
    for names in by_module.values():
        lines += ["", *_command_section(names)]
    return "\n".join(lines) + "\n"


def _command_section(names: list[str]) -> list[str]:
    _, parser = make_parser(names[0])
    lines = [f"## pdserve {' | '.join(names)}", ""]
    if len(names) > 1:
        lines += [" / ".join(f"`{n}`: {COMMANDS[n][1]}" for n in names), ""]
    else:
        lines += [f"{COMMANDS[names[0]][1][:1].upper()}{COMMANDS[names[0]][1][1:]}.", ""]
    # argparse keeps its groups and their flags only in these attributes
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = "options" if group.title in ("options", "optional arguments") else group.title
        lines += [f"### {title}", ""]
        lines += [_describe(parser, action) for action in actions]
        lines.append("")
    return lines[:-1]


def _describe(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    names = ", ".join(action.option_strings)
    if not action.option_strings:  # a positional
        names = action.metavar or action.dest
    elif action.nargs != 0:
        metavar = action.metavar or (
            "{" + ",".join(map(str, action.choices)) + "}" if action.choices
            else action.dest.upper())
        names += f" {metavar}"
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "prog": parser.prog}
    if action.nargs != 0 and action.default not in (None, [], argparse.SUPPRESS) \
            and not _says_default(text):
        text = f"{text} (default: `{action.default}`)" if text else \
            f"default: `{action.default}`"
    if action.required:
        text = f"required; {text}" if text else "required"
    return f"- `{names}`: {text}" if text else f"- `{names}`"


def _says_default(help_text: str) -> bool:
    """The help text names the default itself (some are not the declared value: a
    measured one, an environment variable's)."""
    return help_text.startswith("default") or any(
        said in help_text for said in ("(default", "default:", "; default"))


def _anchor(names: list[str]) -> str:
    """GitHub's anchor of the section heading `pdserve <names joined by ' | '>`."""
    return "pdserve-" + "--".join(names)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
