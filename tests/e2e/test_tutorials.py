"""The tutorials' commands (docs/tutorials/*.md), so that none goes stale.

A fenced bash block after `<!-- test: run -->` is run, in order, in one temporary folder per page
(`<!-- test: run in the repository -->`: at the repository's root); one after
`<!-- test: as in PATH -->` must hold only commands that PATH, a script CI runs, runs with the same
flags; and every `pipelinerl` command of any block must use only flags its `--help` lists (every
`node` example, only options the example reads).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "docs" / "tutorials"
BLOCK = re.compile(r"(?:<!-- test: (?P<mark>[^>]+?) -->\n)?```bash\n(?P<body>.*?)```", re.DOTALL)
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;"}
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
COMPOSE_GLOBALS = {"-p", "-f", "--env-file", "--project-name", "--file"}
BIN = Path(sys.executable).parent
EXAMPLES = ROOT / "clients" / "typescript" / "examples"
BLOCK_TIMEOUT_S = 180


@dataclass(frozen=True)
class Block:
    page: Path
    mark: str | None
    body: str


def blocks(page: Path) -> list[Block]:
    return [Block(page, m["mark"], m["body"]) for m in BLOCK.finditer(page.read_text())]


def every_block() -> list[Block]:
    return [block for page in sorted(TUTORIALS.glob("*.md")) for block in blocks(page)]


def commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script, less heredoc bodies, comments and redirections'
    operators: each a list of words, leading `NAME=value` assignments included."""
    lines, terminator = [], None
    for line in script.replace("\\\n", " ").splitlines():
        if terminator is not None:
            terminator = None if line.strip() == terminator else terminator
            continue
        lines.append(line)
        if heredoc := HEREDOC.search(line):
            terminator = heredoc.group(1)
    found: list[list[str]] = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            words = list(lexer)
        except ValueError:  # a quote that spans lines (an awk program): not a command to compare
            continue
        command: list[str] = []
        for word in [*words, ";"]:
            if word in OPERATORS:
                if command:
                    found.append(command)
                command = []
            else:
                command.append(word)
    return found


def head_and_flags(command: list[str]) -> tuple[tuple[str, ...], set[str]] | None:
    """(program, subcommand) and the flags (and assigned variables) of a compose or pipelinerl
    command; None for any other."""
    assigned = {word.split("=", 1)[0] + "=" for word in command if ASSIGNMENT.match(word)}
    words = [word for word in command if not ASSIGNMENT.match(word)]
    if words[:1] == ["timeout"]:
        words = words[2:]
    if words[:2] == ["docker", "compose"] or words[:1] in (["docker-compose"], ["$compose"]):
        rest = words[2:] if words[0] == "docker" else words[1:]
        while rest and rest[0] in COMPOSE_GLOBALS:
            rest = rest[2:]
        program = "compose"
    elif words and Path(words[0]).name == "pipelinerl":
        program, rest = "pipelinerl", words[1:]
    else:
        return None
    flags = {word.split("=", 1)[0] for word in rest[1:] if word.startswith("-") and word != "-"}
    return (program, rest[0]), flags | assigned


@functools.cache
def pipelinerl_help(*words: str) -> str:
    env = {**os.environ, "COLUMNS": "400", "TERM": "dumb", "NO_COLOR": "1"}
    answer = subprocess.run(
        [str(BIN / "pipelinerl"), *words, "--help"], capture_output=True, text=True, env=env
    )
    assert answer.returncode == 0, f"pipelinerl {' '.join(words)} --help: {answer.stderr[-2000:]}"
    return answer.stdout


def listed(flag: str, text: str) -> bool:
    """`--eval` is in `--eval X` but not in `--eval-every`."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def flags_of(command: list[str]) -> list[str]:
    return [word.split("=", 1)[0] for word in command if word.startswith("--")]


def test_every_page_is_tested_somehow() -> None:
    pages = [page for page in sorted(TUTORIALS.glob("*.md")) if page.name != "index.md"]
    assert len(pages) >= 7
    for page in pages:
        tested = [b for b in blocks(page) if b.mark or "pipelinerl " in b.body or "node " in b.body]
        assert tested, f"{page.name}: no block is run, compared with a script, or checked against --help"


def unknown_flags(words: list[str]) -> list[str] | None:
    """The flags of a `pipelinerl` command its --help does not list, or of a `node` example that
    the example does not read; None for any other command."""
    if Path(words[0]).name == "pipelinerl":
        depth = 2 if words[1:2] == ["serve"] else 1
        page = pipelinerl_help(*words[1 : 1 + depth])
        return [flag for flag in flags_of(words) if not listed(flag, page)]
    if words[0] == "node" and "/examples/" in words[1]:
        source = (EXAMPLES / Path(words[1]).with_suffix(".ts").name).read_text()
        source += (EXAMPLES / "cli.ts").read_text()
        return [flag for flag in flags_of(words) if not re.search(rf'"?{flag[2:]}"?:', source)]
    return None


def test_pipelinerl_and_example_flags_exist() -> None:
    checked = 0
    for block in every_block():
        for command in commands(block.body):
            words = [word for word in command if not ASSIGNMENT.match(word)]
            missing = unknown_flags(words) if words else None
            if missing is not None:
                checked += 1
                assert not missing, f"{block.page.name}: `{shlex.join(command)}` uses unknown flags {missing}"
    assert checked >= 10


COMPARED = [block for block in every_block() if (block.mark or "").startswith("as in ")]


@pytest.mark.parametrize("block", COMPARED, ids=[f"{b.page.name}-{i}" for i, b in enumerate(COMPARED)])
def test_commands_are_the_ones_ci_runs(block: Block) -> None:
    script = ROOT / block.mark.removeprefix("as in ")  # type: ignore[union-attr]
    runs = [found for c in commands(script.read_text()) if (found := head_and_flags(c))]
    compared = 0
    for command in commands(block.body):
        mine = head_and_flags(command)
        if mine is None:
            continue
        compared += 1
        head, flags = mine
        candidates = [theirs for their_head, theirs in runs if their_head == head]
        assert candidates, f"{script.name} never runs `{' '.join(head)}` ({block.page.name})"
        assert any(flags <= theirs for theirs in candidates), (
            f"{block.page.name}: `{shlex.join(command)}`: {script.name} runs `{' '.join(head)}` "
            f"with {[sorted(c) for c in candidates]}, not with all of {sorted(flags)}"
        )
    assert compared, f"{block.page.name}: a block marked `as in` without a command to compare"


def runnable_pages() -> list[Path]:
    pages = sorted(TUTORIALS.glob("*.md"))
    return [page for page in pages if any((b.mark or "").startswith("run") for b in blocks(page))]


@pytest.mark.slow
@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: p.name)
def test_runnable_blocks_run(page: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    for block in blocks(page):
        if block.mark not in ("run", "run in the repository"):
            continue
        cwd = ROOT if block.mark == "run in the repository" else tmp_path
        # a session of its own, so that a block past its time is stopped with what it started
        block_run = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", block.body],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = block_run.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(block_run.pid, signal.SIGTERM)
            output, _ = block_run.communicate()
        tail = f"{block.body}\n---\n{output[-4000:]}"
        assert block_run.returncode == 0, f"{page.name}: exit {block_run.returncode}:\n{tail}"
