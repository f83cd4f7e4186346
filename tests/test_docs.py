"""The docs stay usable: a README a newcomer reads in five minutes, links that lead somewhere, every command
and option of the CLI documented, and CI running the test command the README shows."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI_DOC = ROOT / "docs" / "cli.md"
README_MAX_LINES = 200  # issue 34: the README renders in at most 200 lines

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_files() -> list[Path]:
    return [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor, a repeated one suffixed -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = INLINE_CODE.sub("code", text)  # `[x](y)` in code is not a link
    return LINK.findall(text)


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines: move detail to docs/ (at most {README_MAX_LINES})"


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not checked offline
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, f"{path.name}: " + "; ".join(broken)


def cli_commands() -> dict[str, argparse.ArgumentParser]:
    from picompile import cli

    parser = cli._parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def test_every_command_and_option_is_in_the_cli_reference():
    doc = CLI_DOC.read_text()
    commands = cli_commands()
    assert {"build", "run"} <= set(commands), sorted(commands)
    missing = []
    for name, sub in commands.items():
        if not re.search(rf"picompile {re.escape(name)}\b", doc):
            missing.append(f"picompile {name}")
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            if not any(re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", doc) for flag in action.option_strings):
                missing.append(f"picompile {name} {'/'.join(action.option_strings)}")
    assert not missing, f"docs/cli.md does not document: {', '.join(missing)}"


def test_ci_runs_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    command = ci[-1]
    assert command.startswith("pip install"), command
    blocks = re.findall(r"^```sh\n(.*?)^```", README.read_text(), re.M | re.S)
    assert any(command in block.splitlines() for block in blocks), (
        f".ci/run runs {command!r}, which README.md no longer shows as a command")


def _table(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown table whose header row starts with `header`."""
    lines = [line.strip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:  # past the header and its --- row
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_models_page_lists_every_gguf_architecture_and_ggml_type_as_the_tables_hold_them():
    """docs/models.md names each registered architecture with how its file stores q / k rows and biases and whether
    it norms each head's q / k, and each ggml type with what a build does with it, the format keeping it, the
    --weight-dtype values keeping its values and auto's format, as passes/architectures/ and passes/formats/ggml.py
    hold them."""
    from passes.architectures import ARCHITECTURES
    from passes.formats.ggml import AUTO_FALLBACK, GGML_TYPES

    text = (ROOT / "docs" / "models.md").read_text()
    rows = _table(text, "| architecture |")
    assert [row[0].strip("`") for row in rows] == list(ARCHITECTURES)
    for row in rows:  # q / k rows and biases as the architecture's module says
        arch = ARCHITECTURES[row[0].strip("`")]
        assert row[2].startswith(arch.qk_rows.value) and row[3] == arch.qkv_bias.value, row
        assert row[4].startswith("per head, before RoPE") if arch.qk_norm else row[4] == "none", row
    listed = []
    for row in _table(text, "| ggml type |"):
        for name in row[0].split(", "):
            t = GGML_TYPES[name]
            status = ("refused" if not t.read else "kept in its own blocks" if t.kept_in_blocks else
                      "kept as stored" if t.exact else "re-rounded")
            auto = (t.auto_format or AUTO_FALLBACK) if t.read else ""
            assert row[1].startswith(status) and row[2] == (t.format or ""), (name, row)
            assert row[3] == ", ".join(t.exact_in) and row[4] == auto, (name, row)
            listed.append(name)
    assert sorted(listed) == sorted(GGML_TYPES)
