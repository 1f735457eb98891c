"""python -m tecupy --check (tecupy.check): on a machine with no GPU it says why, proves
that NVRTC compiles and exits 0; on a GPU every kernel family is compiled, run and checked
against the NumPy reference, and a failed family exits 1. The GPU path's logic is also
run here with NumPy standing in for CuPy."""
import os
import time

import numpy as np
import pytest

from tecupy import check, loader


@pytest.fixture
def no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TECUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(check, "gpu_problem", lambda: "CuPy sees no CUDA device")


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """The GPU path with NumPy arrays (the probes then run the reference twice)."""
    monkeypatch.setenv("TECUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(check, "gpu_problem", lambda: None)
    monkeypatch.setattr(check, "_version_lines", lambda problem: ["gpu           fake"])
    monkeypatch.setattr(check, "_gpu_arrays", lambda: np)
    monkeypatch.setattr(loader, "arch_of_device", lambda: "sm_90a")


def test_no_gpu_says_why_and_proves_nvrtc(no_gpu):
    lines = []
    ok, text = check.check(echo=lines.append)
    assert ok and text == "\n".join(lines)
    assert "gpu           none: CuPy sees no CUDA device" in text
    assert "nvrtc compile ok: delayed_scaling.cu for sm_90a" in text
    assert "no GPU: kernels not run" in text
    for part in ("python ", "numpy ", "include roots", "headers ", "cache "):
        assert part in text


def test_headers_line_names_each_family(no_gpu):
    _, text = check.check()
    (line,) = [t for t in text.splitlines() if t.startswith("headers ")]
    for family in ("CUDA", "CCCL", "CUTLASS/CuTe"):
        assert family in line


def test_main_exits_0_without_gpu(no_gpu, capsys):
    assert check.main() == 0
    assert "no GPU" in capsys.readouterr().out


def test_nvrtc_failure_is_reported(no_gpu, monkeypatch):
    def broken(*args):
        raise loader.CompileError("NVRTC failed to compile delayed_scaling.cu\nlog")
    monkeypatch.setattr(loader, "compile_uncached", broken)
    ok, text = check.check()
    assert ok  # a CPU-only machine still runs the reference
    assert "nvrtc compile FAILED: delayed_scaling.cu for sm_90a: CompileError" in text


@pytest.mark.parametrize("family", list(check.PROBES))
def test_every_probe_runs_on_the_reference(family):
    ok, line = check.run_family(family, np)
    assert ok and f"{family} " in line and "=reference" in line, line


def test_fake_gpu_all_ok(fake_gpu, monkeypatch):
    monkeypatch.delenv("TECUPY_STRICT", raising=False)
    ok, text = check.check()
    assert ok, text
    assert "result: ok" in text
    assert sum(f"  {f} " in text for f in check.PROBES) == len(check.PROBES)
    assert "TECUPY_STRICT" not in os.environ  # set for the families only


def test_failed_family_is_reported_and_exits_1(fake_gpu, monkeypatch, capsys):
    def broken(xp):
        raise loader.CompileError("NVRTC failed to compile act.cu\nthe log")

    calls = []

    def wrong(xp):  # the first call stands for the GPU's: twice the reference's values
        calls.append(xp)
        return [xp.ones(3) * (2.0 if len(calls) == 1 else 1.0)]
    monkeypatch.setitem(check.PROBES, "act", (broken, 0.05))
    monkeypatch.setitem(check.PROBES, "norm", (wrong, 0.05))
    assert check.main() == 1
    out = capsys.readouterr().out
    assert "act              FAILED  CompileError: NVRTC failed to compile act.cu" in out
    assert "norm             FAILED  error 1.00e+00 > 0.05" in out
    assert "result: FAILED: norm, act" in out


@pytest.mark.gpu
def test_check_on_this_gpu(tmp_path, monkeypatch, capsys):
    """Cold cache: every family compiles, runs and matches the reference, in seconds."""
    monkeypatch.setenv("TECUPY_CACHE_DIR", str(tmp_path))
    t0 = time.perf_counter()
    ok, text = check.check(echo=print)
    assert ok, text
    for family in check.PROBES:
        (line,) = [t for t in text.splitlines() if t.startswith(f"  {family} ")]
        assert " ok " in line, line
    assert time.perf_counter() - t0 < 60, "the check should take ~30 s with a cold cache"
