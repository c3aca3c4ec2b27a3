"""The one Jinja environment, and rendering a spec to a CUDA translation unit."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jinja2

from ..paths import templates_dir
from ..model import KernelSpec
from .context import build_context

_LEFTOVER_MARKERS = ("{{", "{%", "{#")


class RenderError(RuntimeError):
    pass


@dataclass(frozen=True)
class RenderedKernel:
    spec: KernelSpec
    name: str
    source: str
    template: str  # path of the template, relative to templates/


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir() / "kernels")),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(spec: KernelSpec) -> RenderedKernel:
    try:
        source = environment().get_template(spec.TEMPLATE).render(**build_context(spec))
    except jinja2.TemplateError as exc:
        raise RenderError(f"{spec.name}: rendering {spec.TEMPLATE} failed: {exc}") from exc
    for marker in _LEFTOVER_MARKERS:
        if marker in source:
            line = source[: source.index(marker)].count("\n") + 1
            raise RenderError(f"{spec.name}: rendered source still holds {marker!r} at line {line}")
    return RenderedKernel(spec=spec, name=spec.name, source=source,
                          template=f"kernels/{spec.TEMPLATE}")
