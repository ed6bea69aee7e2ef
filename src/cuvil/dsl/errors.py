"""Rule-file errors, reported as ``path:line:col: message`` followed by the offending line and a caret."""
from __future__ import annotations

from typing import Optional

from ..errors import CuvilError


class RuleError(CuvilError):
    """An error in a ``.rule`` file, located at ``path:line:col`` (``path: message`` where no line applies)."""

    #: Every rule error's next step unless it gives its own: the grammar is documented with examples.
    default_hint = "fix the rule there (docs/rules.md has the grammar, with examples), then run `cuvil rules check FILE` again"

    def __init__(self, message: str, path: str = "<string>", line: int = 0, col: int = 0,
                 source: Optional[str] = None, hint: Optional[str] = None):
        self.message, self.path, self.line, self.col = message, path, line, col
        # line 0 means "no position" (a missing file): "missing.rule:0:0:" would send the user to a line that is not there
        text = f"{path}:{line}:{col}: {message}" if line > 0 else f"{path}: {message}"
        if source is not None and 0 < line <= len(source.splitlines()):
            src_line = source.splitlines()[line - 1]
            text += f"\n    {src_line}\n    {' ' * max(col - 1, 0)}^"
        super().__init__(text, hint=hint)
