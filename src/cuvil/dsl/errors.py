"""Rule-file errors, reported as ``path:line:col: message`` followed by the offending line and a caret."""
from __future__ import annotations

from typing import Optional

from ..errors import CuvilError


class RuleError(CuvilError):
    def __init__(self, message: str, path: str = "<string>", line: int = 0, col: int = 0,
                 source: Optional[str] = None):
        self.message, self.path, self.line, self.col = message, path, line, col
        text = f"{path}:{line}:{col}: {message}"
        if source is not None and 0 < line <= len(source.splitlines()):
            src_line = source.splitlines()[line - 1]
            text += f"\n    {src_line}\n    {' ' * max(col - 1, 0)}^"
        super().__init__(text)
