"""Emitted code and config folded to LINE_WIDTH columns (issue 19: a normal terminal shows them unwrapped).

Every dialect goes through fold(): Python, YAML, TOML and shell share `#` comments, so the folds are the same:
- a comment line longer than the width is wrapped, each part a comment at the same indent;
- a code line whose trailing comment (`code  # why`, two spaces as the emitters write it) makes it too long gets
  the comment on lines of its own above it (below the last line of a shell command continued with a backslash:
  a comment line inside it would end the command);
- a shell command too long (torchrun, srun: a line starting with one) breaks before its options with `\\`.
What is left too long is the emitter's to write shorter; tests/unit/test_emit_width.py holds every dialect to it.
"""

from __future__ import annotations

import re
import textwrap

from planner.line_width import LINE_WIDTH

_TRAILING_COMMENT = re.compile(r"^(?P<code>\S.*?|\s+\S.*?)  # (?P<comment>.*)$")
_SHELL_COMMANDS = ("torchrun ", "srun ", "accelerate launch ", "python -m torch.distributed.run ")


def _comment_lines(indent: str, text: str) -> list[str]:
    return textwrap.wrap(text, LINE_WIDTH - len(indent) - 2, initial_indent=f"{indent}# ",
                         subsequent_indent=f"{indent}# ", break_long_words=False, break_on_hyphens=False)


def _shell_lines(line: str) -> list[str]:
    indent = line[: len(line) - len(line.lstrip())]
    words = re.split(r" (?=--?\w)", line.strip())
    out, current = [], indent + words[0]
    for word in words[1:]:
        if len(current) + 1 + len(word) + 2 > LINE_WIDTH:
            out.append(current + " \\")
            current = indent + "    " + word
        else:
            current += " " + word
    return out + [current]


def fold(text: str) -> str:
    """`text` with every foldable line at most LINE_WIDTH columns (see the module's docstring)."""
    out: list[str] = []
    for line in text.split("\n"):
        if len(line) <= LINE_WIDTH:
            out.append(line)
            continue
        stripped = line.lstrip()
        indent = line[: len(line) - len(stripped)]
        if stripped.startswith("#"):
            out.extend(_comment_lines(indent, stripped.lstrip("#").strip()))
            continue
        match = _TRAILING_COMMENT.match(line)
        if match and '"""' not in match["code"]:
            comment, code = _comment_lines(indent, match["comment"]), match["code"].rstrip()
            code_lines = _shell_lines(code) if stripped.startswith(_SHELL_COMMANDS) else [code]
            if not (out and out[-1].rstrip().endswith("\\")):
                out.extend(comment + code_lines)
            elif not code_lines[-1].endswith("\\"):  # the last line of a continued command: the comment after it
                out.extend(code_lines + comment)
            else:  # inside a continued command a comment line would end it
                out.append(line)
            continue
        out.extend(_shell_lines(line) if stripped.startswith(_SHELL_COMMANDS) else [line])
    return "\n".join(out)


def fit_lines(lines: list[str], width: int = LINE_WIDTH) -> list[str]:
    """Every line at most `width` characters: a long comment wrapped, a long trailing comment moved above its
    code (same indentation). Code itself is written short enough."""
    out = []
    for line in (part for text in lines for part in text.split("\n")):
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        if line.startswith("from ") and " import " in line and "(" not in line:
            module, _, names = line.partition(" import ")
            out += [f"{module} import (", f"    {names})"]
            continue
        code, sep, comment = line.partition("  # ")
        if line.lstrip().startswith("#"):
            code, comment = "", line.lstrip()[1:].strip()
        elif not sep:
            out += _split_code(line, width)
            continue
        out += textwrap.wrap(comment, width, initial_indent=indent + "# ", subsequent_indent=indent + "# ",
                             break_long_words=False, break_on_hyphens=False)
        if code:
            out += _split_code(code, width)
    return out


def _split_code(line: str, width: int) -> list[str]:
    """A code line past `width` broken after its first opening bracket (Python continues inside brackets)."""
    if len(line) <= width:
        return [line]
    indent = line[:len(line) - len(line.lstrip())]
    at = min((i for i in (line.find("("), line.find("[")) if i >= 0), default=-1)
    if at < 0 or at + 1 >= len(line.rstrip()):
        return [line]
    head, tail = line[:at + 1], indent + "        " + line[at + 1:].lstrip()
    if len(tail) > width and '"' not in tail and "'" not in tail:  # inside the brackets any space may break
        cut = tail.rfind(" ", len(indent) + 9, width)
        if cut > 0:
            return [head, tail[:cut], indent + "        " + tail[cut + 1:]]
    return [head, tail]
