"""The cubin cache cannot lie (issue 19, point 6): a bad entry of any kind is rebuilt with
one warning naming the file, never loaded; 8 threads and 2 processes building one kernel
compile it once and leave one whole entry; the key follows the header roots' versions;
include_dirs finds a CUDA 13 toolkit's include/cccl. Needs NVRTC, not a GPU."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

import tecupy
from tecupy import loader

FILE, NAME, ARCH = "delayed_scaling.cu", "delayed_scaling_update", "sm_90a"
# where the tecupy under test lives (the checkout, or site-packages when CI runs the tests
# against the installed wheel): child processes must import that one
TECUPY_ROOT = pathlib.Path(tecupy.__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TECUPY_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def nvrtc_calls(monkeypatch):
    """Counts NVRTC compiles; each one takes 0.3 s longer, to widen a race's window."""
    calls, real = [], loader._nvrtc

    def slow(*args):
        calls.append(args)
        time.sleep(0.3)
        return real(*args)
    monkeypatch.setattr(loader, "_nvrtc", slow)
    return calls


def entry(cache):
    (cubin,) = cache.glob("*.cubin")
    return cubin, cubin.with_suffix(".json")


def assert_whole(cache, good=None):
    """One cubin, one metadata file that describes it, no temp files left."""
    import hashlib
    cubin, meta = entry(cache)
    info = json.loads(meta.read_text())
    data = cubin.read_bytes()
    assert info["name"] == NAME and info["size"] == len(data)
    assert info["sha256"] == hashlib.sha256(data).hexdigest()
    assert not list(cache.glob("*.tmp")), "a temp file was left behind"
    if good is not None:
        assert data == good


def _truncate(p):
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])


def _garbage(p):  # same size, other bytes: only the hash can tell
    p.write_bytes(bytes((b + 1) % 256 for b in p.read_bytes()))


CORRUPTIONS = {
    "truncated cubin": ("cubin", _truncate),
    "garbage cubin": ("cubin", _garbage),
    "empty cubin": ("cubin", lambda p: p.write_bytes(b"")),
    "truncated json": ("json", _truncate),
    "garbage json": ("json", lambda p: p.write_bytes(b"\xff\xfe{not json")),
    "json of another shape": ("json", lambda p: p.write_text('["x"]')),
    "old-style json": ("json", lambda p: p.write_text(json.dumps({NAME: "_Z1f"}))),
    "json without cubin": ("cubin", lambda p: p.unlink()),
    "cubin without json": ("json", lambda p: p.unlink()),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_bad_entry_is_rebuilt_with_one_warning(cache, nvrtc_calls, case):
    cubin, lowered = loader.compile_kernel(FILE, NAME, ARCH)
    good = cubin.read_bytes()
    which, spoil = CORRUPTIONS[case]
    victim = cubin if which == "cubin" else cubin.with_suffix(".json")
    spoil(victim)
    other = cubin.with_suffix(".json") if which == "cubin" else cubin
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = loader.compile_kernel(FILE, NAME, ARCH)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1 and "rebuilding" in texts[0], texts
    assert victim.name in texts[0] or other.name in texts[0], texts
    assert again == (cubin, lowered) and len(nvrtc_calls) == 2  # rebuilt, not loaded
    assert_whole(cache, good)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry is a plain hit
        assert loader.compile_kernel(FILE, NAME, ARCH) == (cubin, lowered)
    assert len(nvrtc_calls) == 2


def test_threads_racing_compile_once(cache, nvrtc_calls):
    """8 threads ask for one kernel at once: one compiles, the others wait for its entry
    (the old code shared one temp name per process: FileNotFoundError in 11 of 40 races)."""
    barrier, results, errors = threading.Barrier(8), [], []

    def one():
        barrier.wait()
        try:
            results.append(loader.compile_kernel(FILE, NAME, ARCH))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and not caught
    assert len(results) == 8 and len(set(results)) == 1
    assert len(nvrtc_calls) == 1
    assert_whole(cache)


PROCESS = textwrap.dedent("""
    import pathlib, sys, time
    from tecupy import loader
    cache, me = pathlib.Path(sys.argv[1]), sys.argv[2]
    real, calls = loader._nvrtc, []
    def slow(*args):
        calls.append(1)
        time.sleep(1.0)
        return real(*args)
    loader._nvrtc = slow
    (cache / f"ready-{me}").touch()
    while len(list(cache.glob("ready-*"))) < 2:  # start together
        time.sleep(0.01)
    loader.compile_kernel(*sys.argv[3:6])
    print("compiles", len(calls))
""")


def test_two_processes_compile_once(cache):
    env = dict(os.environ, PYTHONPATH=str(TECUPY_ROOT), TECUPY_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-W", "error", "-c", PROCESS, str(cache),
                               str(i), FILE, NAME, ARCH], cwd=TECUPY_ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    counts = [int(out.split()[-1]) for out, _ in outs]
    assert sorted(counts) == [0, 1], outs  # one compiled, the other used its entry
    assert_whole(cache)


def test_key_follows_header_versions(cache, tmp_path, monkeypatch):
    """Upgrading CUTLASS (a header root's version file) or a header package changes the
    key; the stamp is computed once per process, not per call."""
    root = tmp_path / "fake_cutlass" / "include"
    (root / "cutlass").mkdir(parents=True)
    version = root / "cutlass" / "version.h"
    version.write_text("#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n")
    monkeypatch.setattr(loader, "include_dirs", lambda: [loader.cuda_dir(), root])
    monkeypatch.setattr(loader, "_stamps", {})
    key = lambda: loader._key(FILE, ARCH, NAME, ("-arch=sm_90a",))  # noqa: E731
    k1 = key()
    version.write_text("#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 3\n")
    assert key() == k1  # cached for the process
    monkeypatch.setattr(loader, "_stamps", {})  # a new process
    k2 = key()
    assert k2 != k1
    monkeypatch.setattr(loader, "_stamps", {})
    monkeypatch.setattr(loader, "_package_versions", lambda: [("nvidia-cutlass", "9.9")])
    assert key() not in (k1, k2)


def test_key_covers_the_real_header_roots():
    """Here (pip CUDA 13 + nvidia-cutlass) the stamp reads CUTLASS's and CUDA's versions."""
    dirs = loader.include_dirs()
    found = {n for d in dirs for n in loader._VERSION_FILES if (d / n).is_file()}
    if any((d / "cutlass").is_dir() for d in dirs):
        assert "cutlass/version.h" in found
    if any((d / "cuda.h").is_file() for d in dirs):
        assert "cuda.h" in found
    assert dict(loader._package_versions()).keys() == set(loader._HEADER_PACKAGES)


def test_include_dirs_search_the_toolkits_cccl(tmp_path, monkeypatch):
    """A CUDA 13 toolkit keeps cuda/std, cub and thrust under include/cccl."""
    kit = tmp_path / "cuda-13.0"
    (kit / "include" / "cccl" / "cuda" / "std").mkdir(parents=True)
    monkeypatch.setenv("CUDA_PATH", str(kit))
    dirs = loader.include_dirs()
    assert kit / "include" in dirs and kit / "include" / "cccl" in dirs
    assert dirs.index(kit / "include") < dirs.index(kit / "include" / "cccl")


def test_gemm_template_key_covers_the_cuda_headers(monkeypatch):
    """cutlass_templates/fp8_gemm.cu includes cuda/act_math.cuh: a change in cuda/ must
    rebuild the GEMM too, not only the kernels of cuda/."""
    real = loader._sources_digest
    name = loader.declared("sm_90a")["fp8_gemm.cu"][0]
    before = loader._key("fp8_gemm.cu", "sm_90a", name, ())
    monkeypatch.setattr(loader, "_sources_digest", lambda folder: real(folder) + (
        b"edited" if folder == loader.cuda_dir() else b""))
    assert loader._key("fp8_gemm.cu", "sm_90a", name, ()) != before
