"""The README and docs/*.md still describe the code: every command they show names a real
command and real flags, every module they run exists and takes those flags, and every file
they point at is there.

Commands come from fenced shell blocks (and from plain fences that open with a command, the
usage synopses): each `pdserve <command> ...` must name a command of `pdserve --help`, and
each `--flag` it uses must appear in `pdserve <command> --help`; each `python -m pdserve.X
...` must name a module that exists and whose `--help` lists its flags. Help texts come from
subprocesses, as a user would run them, once per command. Relative markdown links and the
repository paths the prose names must exist. Running the examples is left to the tests of
their parts (tests/bench/test_bench_readme.py runs the `pdserve bench` examples).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT

DOCS = sorted(
    [REPO_ROOT / "README.md", REPO_ROOT / "deploy" / "README.md",
     *(REPO_ROOT / "docs").glob("*.md")]
)
DOC_IDS = [str(doc.relative_to(REPO_ROOT)) for doc in DOCS]
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
HELP_TIMEOUT_S = 120
# A fence at any indentation (list items indent theirs), its language, and its body.
FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"^\[?(--[a-z0-9][a-z0-9-]*)")
# A repository path in prose: under a top folder, naming a file by its extension or a folder.
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:pdserve|serve|kernels|kvstore|router|planner|benchmarks|deploy|tests|docs"
    r"|\.ci)/[\w./-]*?(?:\.(?:py|md|sh|cpp|h|json|jsonl|png|yaml|yml|toml)|/))(?![\w/-])"
)
# A command in running text: `pdserve up --port 8000`, `python -m pdserve.benchmarks.x --y`.
INLINE_COMMAND = re.compile(r"`((?:pdserve|python3? -m (?:pdserve|benchmarks)\.)[^`]*)`")
# Shell operators that end one command and start the next.
SEPARATORS = {"&&", "||", ";", "&", "|", "(", ")", ">", ">>", "<", "2>", "|&"}


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def logical_lines(language: str, body: str) -> list[str]:
    """The block's lines with `\\` continuations joined; in a plain (synopsis) fence an
    indented line continues the one above."""
    body = re.sub(r"\\\n", " ", body)
    lines: list[str] = []
    for line in body.splitlines():
        if language == "" and lines and line[:1].isspace():
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return [line.strip() for line in lines if line.strip()]


def is_command_block(language: str, body: str) -> bool:
    if language in SHELL_LANGUAGES:
        return True
    first = next((line.strip() for line in body.splitlines() if line.strip()), "")
    return language == "" and (first.startswith("pdserve ") or first.startswith("python -m "))


def commands(line: str, is_synopsis: bool) -> list[list[str]]:
    """Each simple command on the line, its words with the leading VAR=value dropped. A
    synopsis's brackets, parentheses and bars are its grammar, not shell: one command."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # an open quote carried into the next line (a JSON body): no command
        return []
    found: list[list[str]] = [[]]
    for word in words:
        if word in SEPARATORS and not is_synopsis:
            found.append([])
        else:
            found[-1].append(word)
    cleaned = []
    for words in found:
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words = words[1:]
        if words:
            cleaned.append(words)
    return cleaned


def flags_of(words: list[str]) -> list[str]:
    return sorted({m.group(1) for word in words if (m := FLAG.match(word))})


def documented_commands(doc: Path) -> list[tuple[str, list[str]]]:
    """(what kind, words) for every `pdserve ...`, `python -m pdserve.X ...` and `python -m
    benchmarks.X ...` (a study, run from the repository) in the doc's
    shell blocks, synopses and inline code."""
    found = []
    for language, body in fenced_blocks(doc.read_text()):
        if not is_command_block(language, body):
            continue
        for line in logical_lines(language, body):
            for words in commands(line, is_synopsis=language == ""):
                if words[0] == "pdserve" and len(words) > 1:
                    found.append(("pdserve", words))
                elif (words[0] in ("python", "python3") and len(words) > 2
                      and words[1] == "-m" and words[2].startswith(("pdserve.", "benchmarks."))):
                    found.append(("module", words[2:]))
    prose = FENCE.sub("", doc.read_text())
    for span in INLINE_COMMAND.findall(prose):
        if "<" in span:  # a placeholder (`pdserve <role> --help`) names no real command
            continue
        for words in commands(span, is_synopsis=False):
            if words[0] == "pdserve" and len(words) > 1:
                found.append(("pdserve", words))
            elif words[0] in ("python", "python3") and len(words) > 2:
                found.append(("module", words[2:]))
    return found


@functools.cache
def help_text(*argv: str) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `python -m ARGV... --help`, as a user would see it."""
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", *argv, "--help"], capture_output=True, text=True,
        timeout=HELP_TIMEOUT_S, cwd=REPO_ROOT, env=env,
    )
    return done.returncode, done.stdout + done.stderr


@functools.cache
def pdserve_commands() -> frozenset[str]:
    code, text = help_text("pdserve.app.cli")
    assert code == 0, text
    listed = text.split("commands:", 1)[1]
    return frozenset(re.findall(r"^  (\S+)  ", listed, re.M))


def missing_flags(flags: list[str], help_output: str) -> list[str]:
    return [flag for flag in flags
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_output)]


@functools.cache
def prefetch_help_texts() -> None:
    """Every --help the docs need, two at a time (each is a Python start-up of ~1.5 s)."""
    wanted = {("pdserve.app.cli",)}
    for doc in DOCS:
        for kind, words in documented_commands(doc):
            if kind == "pdserve":
                wanted.update(("pdserve.app.cli", name) for name in words[1].split("|")
                              if not name.startswith("-"))
            elif flags_of(words[1:]) and importlib.util.find_spec(words[0].split(".")[0]):
                wanted.add((words[0],))
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda argv: help_text(*argv), sorted(wanted)))


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_every_documented_command_and_flag_exists(doc: Path) -> None:
    prefetch_help_texts()
    problems = []
    for kind, words in documented_commands(doc):
        shown = " ".join(words)
        if kind == "pdserve":
            names = words[1].split("|")  # `pdserve health worker|store` style alternatives
            for name in names:
                if name.startswith("-"):
                    continue
                if name not in pdserve_commands():
                    problems.append(f"`pdserve {name}` is not a command: {shown}")
                    continue
                code, text = help_text("pdserve.app.cli", name)
                if code != 0:
                    problems.append(f"`pdserve {name} --help` exits {code}: {text[-500:]}")
                    continue
                problems += [f"`pdserve {name}` has no {flag}: {shown}"
                             for flag in missing_flags(flags_of(words[2:]), text)]
        else:
            module, flags = words[0], flags_of(words[1:])
            try:
                spec = importlib.util.find_spec(module)
            except ModuleNotFoundError:
                spec = None
            if spec is None:
                problems.append(f"no module {module}: python -m {shown}")
                continue
            if not flags:
                continue
            code, text = help_text(module)
            if code != 0:
                problems.append(f"`python -m {module} --help` exits {code}: {text[-500:]}")
                continue
            sub = words[1] if len(words) > 1 else ""
            if re.fullmatch(r"[a-z][a-z0-9-]*", sub) and re.search(
                    rf"{{[^}}]*\b{re.escape(sub)}\b[^}}]*}}", text):
                # `python -m module SUBCOMMAND --flag`: the flags are the subcommand's
                module = f"{module} {sub}"
                code, text = help_text(*module.split())
                if code != 0:
                    problems.append(f"`python -m {module} --help` exits {code}: "
                                    f"{text[-500:]}")
                    continue
            problems += [f"`python -m {module}` has no {flag}: python -m {shown}"
                         for flag in missing_flags(flags, text)]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_every_relative_link_resolves(doc: Path) -> None:
    text = FENCE.sub("", doc.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on this page
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    assert broken == [], f"{doc.name} links to missing files: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_every_repository_path_named_exists(doc: Path) -> None:
    """A path the prose names (`pdserve/serve/engine/scheduler.py`, `deploy/overlays/`) is read from
    the repository root; a moved or deleted file shows up here."""
    missing = sorted({path for path in REPO_PATH.findall(doc.read_text())
                      if not (REPO_ROOT / path).exists()})
    assert missing == [], f"{doc.name} names paths that do not exist: {missing}"


def test_the_documents_show_commands() -> None:
    """The parser must keep finding what it checks: the README's `pdserve up`, the fleet's
    roles, the planner's commands."""
    shown = {words[1] for doc in DOCS for kind, words in documented_commands(doc)
             if kind == "pdserve"}
    assert {"up", "router", "store", "prefill", "decode", "plan", "profile"} <= shown


def test_the_checker_sees_a_wrong_flag(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```bash\nFOO=1 pdserve up --port 8000 \\\n    --no-such-flag && echo ok\n```\n"
        "```\npdserve plan --profile FILE\n      [--seed 0] (--input-len L | --x Y)\n```\n"
        "```sh\nM=$(python -c 'import x') python3 -m pdserve.m --a 1 > out # --b\n```\n"
    )
    found = documented_commands(doc)
    assert found == [
        ("pdserve", ["pdserve", "up", "--port", "8000", "--no-such-flag"]),
        ("pdserve", ["pdserve", "plan", "--profile", "FILE", "[--seed", "0]", "(", "--input-len",
                     "L", "|", "--x", "Y", ")"]),
        ("module", ["pdserve.m", "--a", "1"]),
    ]
    assert flags_of(found[1][1]) == ["--input-len", "--profile", "--seed", "--x"]
    assert missing_flags(["--port", "--no-such-flag"], "  --port PORT  the port") == [
        "--no-such-flag"]


def test_the_readme_install_and_test_commands_are_what_ci_runs() -> None:
    """.ci/run installs from scratch the way the README's first command does, and runs the
    README's test command."""
    readme = (REPO_ROOT / "README.md").read_text()
    install = re.search(r"pip install torch==(\S+) && pip install -e '\.\[([a-z,]+)\]'", readme)
    assert install, "the README lost its install line"
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert f"pip install -q torch=={install.group(1)}" in ci
    assert f"pip install -q -e '.[{install.group(2)}]'" in ci
    assert "```bash\npython -m pytest -q\n```" in readme
    assert re.search(r"^python -m pytest -q$", ci, re.M)
