"""Reads README.md's fenced code blocks and the markers that say which Python blocks run.

The convention (strict: a ```python block without a marker is an error, so a new section cannot
slip in an example nobody runs):

    <!-- runnable: file=train.py check=loss-falls -->      right before a ```python fence: a whole
    ```python                                               script, written to train.py
    ...
    ```
    <!-- file: ds.json -->                                  any later block (json, yaml, ...): a file
    ```json                                                 the example needs, written beside it
    ...
    ```
    <!-- command -->                                        exactly one block: the shell command that
    ```bash                                                 runs the example, run as shown
    deepspeed_c --num_gpus 2 train.py --deepspeed_config ds.json
    ```

    <!-- not-runnable: why -->                              right before a ```python fence: a fragment
                                                            (names the reader supplies, GPUs it needs)

`check=` names what a run must show besides exit code 0, comma separated:
    loss-falls       the output has at least 3 `loss <number>` values and the last is below half
                     the first
    creates:PATH     PATH exists (relative to the example's directory) after the run
Markers for blocks in other languages are optional, except `file:` and `command`, which must sit
between a runnable block and the next one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*(.*?)\s*-->\s*$")
CHECKS = ("loss-falls", "creates:")

HOW_TO_MARK = ("put `<!-- runnable: file=NAME.py check=loss-falls -->` on the line right before the fence "
               "(then a `<!-- file: ds.json -->` block for each file it needs and one `<!-- command -->` "
               "block with the command that runs it), or `<!-- not-runnable: why -->` if it is a fragment; "
               "see tests/distributed/readme_blocks.py")


class ReadmeConventionError(AssertionError):
    """README.md breaks the marker convention; the message lists every place and what to do."""


@dataclass
class Block:
    lang: str
    body: str
    line: int  # 1-based line of the opening fence
    marker: str | None  # the text inside `<!-- ... -->` on the last non-blank line before the fence


@dataclass
class Example:
    """One runnable block with the files it needs and the command that runs it."""

    script: str
    line: int
    files: dict[str, str] = field(default_factory=dict)
    command: str | None = None
    checks: list[str] = field(default_factory=list)


def blocks(text: str) -> list[Block]:
    lines = text.split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        before = [ln for ln in lines[:i] if ln.strip()]
        found = _MARKER.match(before[-1].strip()) if before else None
        out.append(Block(opened.group(1).lower(), "\n".join(lines[i + 1:j]) + "\n", i + 1,
                         found.group(1) if found else None))
        i = j + 1
    return out


def _runnable(block: Block, errors: list[str]) -> Example | None:
    fields = dict(tok.split("=", 1) for tok in block.marker.split(":", 1)[1].split() if "=" in tok)
    script, checks = fields.get("file", ""), [c for c in fields.get("check", "").split(",") if c]
    where = f"README.md line {block.line}"
    if not script.endswith(".py") or "/" in script:
        errors.append(f"{where}: a runnable marker needs file=NAME.py (a plain file name), got {block.marker!r}")
        return None
    bad = [c for c in checks if not c.startswith(CHECKS) or c == "creates:"]
    if not checks or bad:
        errors.append(f"{where}: a runnable marker needs check=loss-falls and/or check=creates:PATH (what a run "
                      f"must show besides exit code 0), got {block.marker!r}")
        return None
    return Example(script=script, line=block.line, files={script: block.body}, checks=checks)


def plan(text: str) -> list[Example]:
    """The runnable examples of a README, or ReadmeConventionError listing every violation."""
    errors: list[str] = []
    examples: list[Example] = []
    current: Example | None = None  # the runnable block whose files and command come next

    def close() -> None:
        if current is not None and current.command is None:
            errors.append(f"README.md line {current.line}: the runnable block ({current.script}) has no "
                          "`<!-- command -->` block after it; add one with the command that runs it")

    for block in blocks(text):
        marker = block.marker or ""
        kind = marker.split(":", 1)[0].strip()
        where = f"README.md line {block.line}"
        if block.lang == "python":
            if kind == "runnable":
                close()
                current = _runnable(block, errors)
                if current is not None:
                    examples.append(current)
            elif kind == "not-runnable" and marker.split(":", 1)[1:] and marker.split(":", 1)[1].strip():
                close()
                current = None
            else:
                found = f"found {('<!-- ' + marker + ' -->')!r}" if block.marker else "found no marker"
                errors.append(f"{where}: ```python block without a runnable/not-runnable marker ({found}): "
                              f"{HOW_TO_MARK}")
            continue
        if kind == "file":
            name = marker.split(":", 1)[1].strip() if ":" in marker else ""
            if current is None or current.command is not None or not name or "/" in name:
                errors.append(f"{where}: `<!-- {marker} -->` must name a plain file and sit after a runnable "
                              "```python block, before its `<!-- command -->` block")
            else:
                current.files[name] = block.body
        elif kind == "command":
            if current is None or current.command is not None:
                errors.append(f"{where}: `<!-- command -->` must follow a runnable ```python block (one each)")
            elif current.script not in block.body:
                errors.append(f"{where}: the command does not run {current.script}: {block.body.strip()!r}")
            else:
                current.command = block.body.strip()
    close()
    if errors:
        raise ReadmeConventionError("README.md's code blocks break the marker convention:\n  " + "\n  ".join(errors))
    return examples
