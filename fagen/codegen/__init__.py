"""Stage 2: render kernel specs to CUDA source through the one Jinja environment."""

from .context import build_context
from .render import RenderedKernel, RenderError, environment, render

__all__ = ["build_context", "RenderedKernel", "RenderError", "environment", "render"]
