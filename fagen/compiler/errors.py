"""Errors of the compile stage, each carrying what a user needs to act on it."""

from __future__ import annotations

from pathlib import Path


class ToolchainError(RuntimeError):
    """NVRTC or cuobjdump is missing or misbehaves: not the kernel's fault."""


class CompileError(RuntimeError):
    """A kernel that did not compile, or compiled into something we refuse to ship."""

    def __init__(self, message: str, log: str = "", source_path: Path | None = None):
        super().__init__(message)
        self.message = message
        self.log = log
        self.source_path = source_path

    def with_source_path(self, source_path: Path) -> "CompileError":
        return CompileError(self.message, self.log, source_path)

    def log_excerpt(self, max_lines: int = 20) -> str:
        """The first error lines of the log (NVRTC reports errors before their consequences)."""
        lines = [line for line in self.log.splitlines() if line.strip()]
        errors = [line for line in lines if " error" in line or "error:" in line]
        chosen = errors or lines
        excerpt = chosen[:max_lines]
        if len(chosen) > max_lines:
            excerpt.append(f"... ({len(chosen) - max_lines} more lines)")
        return "\n".join(excerpt)

    def __str__(self) -> str:
        where = f" (source: {self.source_path})" if self.source_path else ""
        return f"{self.message}{where}"
