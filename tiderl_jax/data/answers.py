"""Where a final answer sits in a math solution's text: GSM8K's `#### N` line, LaTeX's last `\\boxed{...}`.

Read by the built-in math reward (`builtin.py`) and by the packaged datasets' ground truths (`packaged.py`).
"""

from __future__ import annotations

import re

GSM_ANSWER = re.compile(r"####\s*([^\n]+)")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces balanced), or None."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start:i - 1].strip()
    return None
