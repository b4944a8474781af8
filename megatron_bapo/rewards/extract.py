"""Answer extraction from model responses: last `\\boxed{}` (nested braces), last-number fallback,
and a normalised form used to group equal answers for majority voting.

Pure string code (no sympy) so it is cheap and can run anywhere, including worker threads.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_BOX_COMMANDS = ("\\boxed", "\\fbox")

# Numbers as written in prose: -1,234.5 or 3/4 or .5; thousands separators only in groups of 3.
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?")


def find_boxed(text: str) -> list[str]:
    """Contents of every top-level `\\boxed{...}` / `\\fbox{...}` in `text`, in order.

    Braces nest (`\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`); escaped braces `\\{ \\}` do not count.
    A box nested in a box is unwrapped (`\\boxed{\\boxed{5}}` -> `5`). `\\boxed 5` (no braces)
    takes the next token. An unclosed box (a response cut off mid-answer) yields nothing.
    """
    out: list[str] = []
    pos = 0
    while True:
        start, cmd = _next_box(text, pos)
        if start < 0:
            return out
        i = start + len(cmd)
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            end = _matching_brace(text, i)
            if end < 0:
                return out  # unclosed: nothing after it can be a complete box either
            content = text[i + 1 : end]
            pos = end + 1
        elif i > start + len(cmd) and i < len(text):
            m = re.match(r"[^\s$]+", text[i:])
            content = m.group(0) if m else ""
            pos = i + len(content)
        else:
            pos = i  # `\boxedfoo` or `\boxed` at the end: not a box
            continue
        out.append(_unwrap(content.strip()))


def _next_box(text: str, pos: int) -> tuple[int, str]:
    best, best_cmd = -1, ""
    for cmd in _BOX_COMMANDS:
        j = text.find(cmd, pos)
        while j >= 0 and j + len(cmd) < len(text) and text[j + len(cmd)].isalpha():
            j = text.find(cmd, j + 1)  # `\boxedx` is another command
        if j >= 0 and (best < 0 or j < best):
            best, best_cmd = j, cmd
    return best, best_cmd


def _matching_brace(text: str, open_at: int) -> int:
    depth = 0
    i = open_at
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (`\{`, `\}`, `\\`)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _unwrap(content: str) -> str:
    inner = find_boxed(content)
    if len(inner) == 1:
        start, cmd = _next_box(content, 0)
        if start == 0 and content.rstrip().endswith("}"):
            return inner[0]
    return content


def last_number(text: str) -> Optional[str]:
    """The last number written in `text` (`-3`, `1,234` -> `1234`, `2.5`, `3/4`), or None."""
    found = None
    for m in _NUMBER_RE.finditer(text):
        s = m.group(0)
        if any(c.isdigit() for c in s):
            found = s
    return found.replace(",", "") if found is not None else None


def extract_answer(text: str, *, fallback_last_number: bool = False) -> Optional[str]:
    """The final answer in a response: the last non-empty box; else (optionally) the last number.

    Returns None when there is no answer, which callers score 0 and count as "no_answer".
    """
    boxes = [b for b in find_boxed(text) if b.strip()]
    if boxes:
        answer = boxes[-1].strip()
        # "\boxed{2.}" is sentence punctuation, not a decimal point.
        return answer[:-1].rstrip() if answer.endswith(".") and len(answer) > 1 else answer
    if fallback_last_number:
        return last_number(text)
    return None


_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACING_RE = re.compile(r"\\[,;:! ]|\\quad|\\qquad|~")
_UNIT_SUFFIX_RE = re.compile(r"^(-?[\d.,/]+)\s*(?:[a-zA-Z]+\^?\d?\s*)+$")
_FRAC_RE = re.compile(r"^(-?)\\frac\{?(-?\d+)\}?\{?(\d+)\}?$")


def normalize_answer(answer: Optional[str]) -> Optional[str]:
    """A canonical string for voting: equal answers written differently map to the same key.

    Strips `$`, `\\left/\\right`, spacing, `\\text{}`-style wrappers, degrees, percent signs,
    trailing periods and plain unit words after a number; `\\dfrac`/`\\tfrac` -> `\\frac`;
    plain numbers, decimals and integer fractions become one exact form (`0.5`, `\\frac{1}{2}`,
    `1/2` -> `1/2`; `070` -> `70`). Not a proof of equality: grading uses math-verify.
    """
    if answer is None:
        return None
    s = answer.strip()
    s = s.strip("$").strip()
    if s.startswith("\\(") and s.endswith("\\)"):
        s = s[2:-2]
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SPACING_RE.sub(" ", s)
    for _ in range(3):
        s = _TEXT_CMD_RE.sub(r"\1", s)
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\$", "").strip().rstrip(".").strip()
    m = _UNIT_SUFFIX_RE.match(s)
    if m:
        s = m.group(1)
    s = re.sub(r"\s+", "", s)
    number = _as_fraction(s)
    if number is not None:
        return str(number)
    return s


def _as_fraction(s: str) -> Optional[Fraction]:
    t = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    m = _FRAC_RE.match(t)
    if m:
        sign, num, den = m.groups()
        t = f"{sign}{num}/{den}"
    if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)(/\d+)?", t):
        return None
    try:
        if "/" in t:
            num_s, den_s = t.split("/")
            return Fraction(num_s) / Fraction(den_s)
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None
