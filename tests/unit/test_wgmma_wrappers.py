"""The committed wgmma wrappers are exactly what their generator writes (no hand edits, no
stale N list)."""

import importlib.util

from fagen.paths import include_dir


def test_wgmma_header_matches_its_generator():
    path = include_dir() / "fagen" / "ptx" / "gen_wgmma.py"
    spec = importlib.util.spec_from_file_location("gen_wgmma", path)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.header_path().read_text() == generator.render_header(), (
        "templates/include/fagen/ptx/wgmma.cuh is stale: run python "
        "templates/include/fagen/ptx/gen_wgmma.py"
    )
