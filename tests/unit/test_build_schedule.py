"""fagen.build._compile_all's scheduling without a compiler: compiles in the given order, SASS
checks in batches of one target, at most `jobs` tasks at a time, the first failure raised."""

from __future__ import annotations

import threading
import time
import types

import pytest

from fagen import build
from fagen.compiler import CompileError
from fagen.model import Arch


OPTIONS = {arch: None for arch in Arch}  # what _compile_all hands each task; unused by the fakes


def _rendered(archs: list[str]) -> list:
    return [types.SimpleNamespace(name=f"k{i}", spec=types.SimpleNamespace(arch=Arch(a)))
            for i, a in enumerate(archs)]


class Recorder:
    def __init__(self, cached=()):
        self.cached = set(cached)
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.compiled: list[str] = []
        self.batches: list[list[str]] = []

    def _enter(self):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)

    def _leave(self):
        with self.lock:
            self.running -= 1

    def build_one(self, rendered, source_dir, options, cache):
        self._enter()
        try:
            time.sleep(0.002)
            with self.lock:
                self.compiled.append(rendered.name)
            if rendered.name in self.cached:
                return f"hit {rendered.name}", True
            return f"compiled {rendered.name}", False
        finally:
            self._leave()

    def check_sass(self, items, staging, options, cache):
        self._enter()
        try:
            time.sleep(0.002)
            assert len({r.spec.arch for r, _ in items}) == 1
            with self.lock:
                self.batches.append([r.name for r, _ in items])
            return [f"checked {k}" for _, k in items]
        finally:
            self._leave()


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder(cached={"k3", "k10"})
    monkeypatch.setattr(build, "_build_one", rec.build_one)
    monkeypatch.setattr(build, "_check_sass", rec.check_sass)
    monkeypatch.setattr(build, "_kernel_build", lambda spec, kernel, cached: kernel)
    return rec


def test_every_kernel_once_in_order_with_batched_sass_checks(recorder, tmp_path):
    rendered = _rendered(["sm80", "sm90a"] * 10 + ["sm90"] * 3)
    seen = []
    order = list(reversed(range(len(rendered))))
    results = build._compile_all(rendered, OPTIONS, tmp_path, 2, None,
                                 lambda kernel, done, total: seen.append((kernel, done, total)), order)
    assert results == [(f"hit k{i}", True) if i in (3, 10) else (f"checked compiled k{i}", False)
                       for i in range(len(rendered))]
    assert set(recorder.compiled[:2]) == {"k22", "k21"}  # `order`, two at a time
    checked = [name for batch in recorder.batches for name in batch]
    assert sorted(checked) == sorted(f"k{i}" for i in range(len(rendered)) if i not in (3, 10))
    assert all(len(batch) <= build.SASS_BATCH for batch in recorder.batches)
    assert len(recorder.batches) < len(checked)  # batched, not one per kernel
    assert [(done, total) for _, done, total in seen] == [(n, len(rendered)) for n in range(1, len(rendered) + 1)]
    assert sorted(kernel for kernel, _, _ in seen) == sorted(kernel for kernel, _ in results)
    assert recorder.most <= 2


def test_one_job_runs_one_task_at_a_time(recorder, tmp_path):
    rendered = _rendered(["sm80"] * 12)
    build._compile_all(rendered, OPTIONS, tmp_path, 1, None, None)
    assert recorder.most == 1
    assert recorder.compiled == [f"k{i}" for i in range(12)]


def test_a_failed_sass_check_raises(monkeypatch, tmp_path):
    def refuse(items, staging, options, cache):
        raise CompileError(f"{items[0][0].name}: SASS lacks HMMA", "", None)

    monkeypatch.setattr(build, "_build_one", lambda r, *a: (r.name, False))
    monkeypatch.setattr(build, "_check_sass", refuse)
    with pytest.raises(CompileError, match="SASS lacks HMMA"):
        build._compile_all(_rendered(["sm80"] * 3), OPTIONS, tmp_path, 2, None, None)


def test_a_failed_compile_raises(monkeypatch, tmp_path):
    def fail(rendered, *args):
        raise CompileError(f"{rendered.name}: NVRTC failed to compile the kernel", "log", None)

    monkeypatch.setattr(build, "_build_one", fail)
    with pytest.raises(CompileError, match="NVRTC failed"):
        build._compile_all(_rendered(["sm80"] * 3), OPTIONS, tmp_path, 2, None, None)


def test_the_slow_algorithms_compile_first():
    def spec(fa_version, direction, head_dim):
        return types.SimpleNamespace(fa_version=fa_version, direction=direction, head_dim=head_dim)

    ranked = sorted([spec(2, "fwd", 64), spec(3, "bwd", 128), spec(2, "bwd", 256), spec(3, "fwd", 64)],
                    key=lambda s: -build._expected_seconds(s))
    assert (ranked[0].fa_version, ranked[0].direction) == (3, "bwd")
    assert (ranked[-1].fa_version, ranked[-1].direction) == (2, "fwd")
