"""What a new user meets without the optional parts: no torch, no CUDA device."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_fagen_torch_without_torch_names_the_install():
    # sys.modules["torch"] = None makes `import torch` fail as it does where torch is absent.
    code = "import sys; sys.modules['torch'] = None\nimport fagen.torch"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: fagen.torch needs PyTorch: pip install torch"), last


@pytest.mark.parametrize("tool", ("attention", "launch_overhead", "cold_start"))
def test_benchmarks_without_cuda_say_so_in_one_line(tool, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    module = pytest.importorskip(f"bench.{tool}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert module.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"bench.{tool}: needs a CUDA device (torch {torch.__version__} sees none)"], err


def test_bundle_writes_share_a_fixed_set_of_lock_files(tmp_path, monkeypatch):
    from fagen.bundle.writer import LOCK_SLOTS, BundleWriter

    monkeypatch.setenv("FAGEN_CACHE", str(tmp_path / "cache"))
    for i in range(3 * LOCK_SLOTS):  # every test run writes bundles into fresh directories
        with BundleWriter(tmp_path / f"run-{i}" / "bundle"):
            pass
    locks = list((tmp_path / "cache" / "locks").iterdir())
    assert 1 < len(locks) <= LOCK_SLOTS, sorted(p.name for p in locks)
