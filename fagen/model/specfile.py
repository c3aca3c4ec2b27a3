"""YAML spec files: a bundle name and entries whose fields may be lists (the product expands)."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .. import contract
from .base import KernelSpec
from .tuning import seqlen_bounds

_BUNDLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class SpecError(ValueError):
    """A spec file that cannot be built, with a message naming the entry and field."""


class MaskDeclaration(BaseModel):
    """A user's mask in a spec file: a CUDA header and the type in it (the interface of
    templates/include/fagen/algo/mask.cuh's CustomMask); entries use it by its name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    header: str = Field(description="the header's path, relative to the spec file")
    type: str = Field(description="the C++ type in it that implements the mask")


class SpecFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    bundle: str = Field(description="the bundle's name (letters, digits, '.', '_', '-'); `fagen build` "
                        "writes it to generated/<bundle> unless -o says otherwise")
    description: str = Field("", description="free text, kept in the manifest")
    masks: dict[str, MaskDeclaration] = Field(
        {}, description="user masks by name (header, type): an entry's `mask: NAME` builds its "
        "kernel with that mask compiled in (kind custom; FA2 forward and backward, FA3 forward)")
    kernels: list[dict[str, Any]] = Field(description="the kernel entries (below); a field given as a "
                                          "list expands to one kernel per value")
    include: list[str] = Field([], description="other spec files (paths relative to this one) whose "
                               "kernels join this bundle, e.g. the default bundle's Blackwell kernels")

    @field_validator("bundle")
    @classmethod
    def _check_bundle(cls, value: str) -> str:
        if not _BUNDLE_NAME.match(value):
            raise ValueError(f"bundle={value!r}: use letters, digits, '.', '_' and '-'")
        return value

    @field_validator("masks")
    @classmethod
    def _check_mask_names(cls, value: dict[str, MaskDeclaration]) -> dict[str, MaskDeclaration]:
        for name in value:
            if problem := contract.custom_mask_name_problem(name):
                raise ValueError(problem)
        return value


@dataclass
class Expansion:
    bundle: str
    specs: list[KernelSpec] = field(default_factory=list)
    # Combinations a product produced that the constraints reject: (entry index, fields, why).
    skipped: list[tuple[int, dict[str, Any], str]] = field(default_factory=list)


def _first_error(exc: ValidationError, auto_tile: bool = False) -> str:
    errors = exc.errors()
    if auto_tile and len(errors) > 1:
        # `tile: auto` is resolved from arch and head_dim; where one of them is wrong the tile is
        # missing because of it, and the other error says why.
        errors = [e for e in errors if not (e["loc"] == ("tile",) and e["type"] == "missing")]
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _with_custom_mask(fields: dict[str, Any], masks: dict[str, dict]) -> dict[str, Any]:
    """An entry's `mask: NAME` of the spec file's `masks:` as mask: custom and its custom_mask."""
    name = fields.get("mask")
    if not isinstance(name, str) or name not in masks:
        return fields
    return {**fields, "mask": "custom", "custom_mask": {"name": name, **masks[name]}}


def expand_entry(index: int, entry: dict[str, Any], out: Expansion,
                 masks: dict[str, dict] | None = None) -> None:
    """`masks`: the spec file's user masks by name, each {type, source}."""
    if not isinstance(entry, dict):
        raise SpecError(f"kernels[{index}]: expected a mapping of fields, got {type(entry).__name__}")
    list_fields = {k: v for k, v in entry.items() if isinstance(v, list)}
    if any(len(v) == 0 for v in list_fields.values()):
        empty = [k for k, v in list_fields.items() if not v]
        raise SpecError(f"kernels[{index}]: empty list for {', '.join(empty)}")
    names = list(list_fields)
    for values in itertools.product(*(list_fields[k] for k in names)):
        fields = _with_custom_mask({**entry, **dict(zip(names, values))}, masks or {})
        try:
            spec = KernelSpec.model_validate(fields)
            out.specs.append(spec)
            # `tile: auto` also builds the tuning table's kernels for short sequences; not for
            # score modifiers and split head dims, whose kernels (one per model family's
            # variant) would otherwise double in number for a few percent at 512-1k keys.
            if (fields.get("tile", "auto") == "auto" and "max_seqlen_k" not in fields
                    and not spec.score and spec.head_dim_v is None and spec.custom_mask is None):
                for bound in seqlen_bounds(type(spec), spec.arch, spec.head_dim, spec.mask, spec.dtype):
                    out.specs.append(KernelSpec.model_validate({**fields, "max_seqlen_k": bound}))
        except ValidationError as exc:
            why = _first_error(exc, auto_tile=fields.get("tile", "auto") == "auto")
            if not list_fields:
                raise SpecError(f"kernels[{index}]: {why}") from None
            out.skipped.append((index, dict(zip(names, values)), why))


def _mask_sources(spec_file: SpecFile, base_dir: Path | None) -> dict[str, dict]:
    """Each user mask's {type, source}: its header read relative to the spec file."""
    masks = {}
    for name, declared in spec_file.masks.items():
        path = (base_dir or Path.cwd()) / declared.header
        try:
            source = path.read_text()
        except OSError as exc:
            raise SpecError(f"masks.{name}.header: cannot read {path}: {exc.strerror or exc}") from None
        masks[name] = {"type": declared.type, "source": source}
    return masks


def expand(data: dict[str, Any], base_dir: Path | None = None, _including: tuple[Path, ...] = ()) -> Expansion:
    """Validate a parsed spec file and expand it into kernel specs (duplicates dropped), with
    its included files' kernels; `base_dir`: where the file's relative paths (mask headers,
    includes) start (default: the current directory)."""
    try:
        spec_file = SpecFile.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"spec file: {_first_error(exc)}") from None
    out = Expansion(bundle=spec_file.bundle)
    masks = _mask_sources(spec_file, base_dir)
    for index, entry in enumerate(spec_file.kernels):
        expand_entry(index, entry, out, masks)
    for name in spec_file.include:
        path = ((base_dir or Path.cwd()) / name).resolve()
        if path in _including:
            raise SpecError(f"include: {name} includes itself (through {' -> '.join(p.name for p in _including)})")
        included = load_spec_file(path, _including)
        out.specs.extend(included.specs)
        out.skipped.extend(included.skipped)
    unique: dict[str, KernelSpec] = {}
    for spec in out.specs:
        unique.setdefault(spec.name, spec)
    out.specs = sorted(unique.values(), key=lambda s: s.name)
    if not out.specs:
        raise SpecError("spec file expands to no valid kernel: " +
                        "; ".join(why for _, _, why in out.skipped[:5]))
    return out


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """One line: `path:line:column: not valid YAML: problem (context at line, column)`."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or not problem:
        return f"{path}: not valid YAML: {' '.join(str(exc).split())}"
    text = f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {problem}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        text += f" ({context} that began at line {context_mark.line + 1}, column {context_mark.column + 1})"
    elif context:
        text += f" ({context})"
    return text


def load_spec_file(path: str | Path, _including: tuple[Path, ...] = ()) -> Expansion:
    """The spec file at `path`, expanded (`_including`: the files whose include led here)."""
    path = Path(path)
    if path.is_dir():
        yamls = sorted(p.name for p in path.glob("*.y*ml"))
        hint = f" (YAML files in it: {', '.join(yamls)})" if yamls else ""
        raise SpecError(f"{path} is a directory, not a spec file{hint}")
    try:
        # A binary stream: pyyaml detects the encoding, and its marks name the file.
        with open(path, "rb") as stream:
            data = yaml.safe_load(stream)
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the spec file: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise SpecError(_yaml_error(path, exc)) from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping with 'bundle' and 'kernels'")
    try:
        return expand(data, path.parent, (*_including, path.resolve()))
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
