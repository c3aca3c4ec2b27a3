"""Stage 2: render kernel specs to CUDA source through the one Jinja environment."""

from .context import LaunchInfo, build_context, launch_info
from .render import RenderedKernel, RenderError, environment, render

__all__ = ["LaunchInfo", "build_context", "launch_info", "RenderedKernel", "RenderError",
           "environment", "render"]
