"""Every kernel file compiles with NVRTC for Hopper and Ada on a machine with no GPU, and
the loader reports failures with the file, the options and the log."""
import numpy as np
import pytest

from tecupy import build, loader


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["sm_90a", "sm_89"])
def test_every_kernel_compiles(arch):
    """Every declared instantiation of every kernel file compiles (one program per file)."""
    done = build.check_all([arch])
    files = {f for f, _, _, _ in done}
    want = {p.name for p in loader.cuda_dir().glob("*.cu")}
    if arch == "sm_90a":  # the wgmma/TMA GEMM templates and attention are Hopper-only
        want |= {p.name for p in loader.templates_dir().glob("*.cu")}
    else:
        want -= {"attention_sm90.cu"}
    assert files == want, "every kernel source must be declared by a module in tecupy/kernels"
    assert sum(n for _, _, _, n in done) == sum(map(len, loader.declared(arch).values()))


def test_build_fills_the_cache_once(tmp_path, monkeypatch):
    """A cubin per kernel; a second build takes everything from the cache (two small files:
    the aot test above covers every kernel)."""
    monkeypatch.setenv("TECUPY_CACHE_DIR", str(tmp_path))
    files = ("delayed_scaling.cu", "transpose.cu")
    some = {f: n for f, n in loader.declared("sm_90a").items() if f in files}
    monkeypatch.setattr(loader, "declared", lambda arch=None: some)
    done = build.build(["sm_90a"])
    assert {f for f, _, _ in done} == set(files)
    assert len(list(tmp_path.glob("*-sm_90a-*.cubin"))) == sum(map(len, some.values()))
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.cubin")}
    build.build(["sm_90a"])  # second time: nothing is rewritten
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.cubin")} == stamps


def test_compile_error_names_file_options_and_log(tmp_path, monkeypatch):
    monkeypatch.setenv("TECUPY_CACHE_DIR", str(tmp_path))
    with pytest.raises(loader.CompileError, match=r"(?s)cast\.cu.*-arch=sm_90a.*no_such_kernel"):
        loader.compile_kernel("cast.cu", "no_such_kernel<int>", "sm_90a")


def test_cached_cubin_is_a_whole_elf(tmp_path, monkeypatch):
    """The cubin on disk spans every header and section its ELF header names (CuPy's
    getCUBIN drops the last byte; nvdisasm rejects such a file)."""
    import struct
    monkeypatch.setenv("TECUPY_CACHE_DIR", str(tmp_path))
    name = loader.declared("sm_90a")["delayed_scaling.cu"][0]
    cubin, _ = loader.compile_kernel("delayed_scaling.cu", name, "sm_90a")
    data = cubin.read_bytes()
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    assert len(data) >= phoff + phentsize * phnum
    assert loader.whole_elf(data) == data  # nothing left to pad
    assert loader.whole_elf(data[:-1]) == data[:-1] + b"\0"


def test_include_dirs_found():
    names = [str(d) for d in loader.include_dirs()]
    assert any(n.endswith("cuda") for n in names)


def test_every_fp8_gemm_configuration_fits_in_shared_memory():
    from tecupy.kernels import fp8_gemm as K
    for configs in K.CANDIDATES.values():
        for config in configs:
            assert K.smem_bytes(config, staging=True) <= K.SMEM_MAX, config


@pytest.mark.parametrize("m, n, split, want", [
    (4096, 4096, True, 256),    # 192-wide tiles: 5.33 waves on 132 SMs; 256-wide: 3.88
    (8192, 12288, True, 192), (8192, 4096, True, 192), (8192, 16384, True, 192),
    (4096, 4096, False, 256), (100, 40, True, 192)])
def test_default_config_follows_the_waves(m, n, split, want):
    from tecupy.kernels import fp8_gemm as K
    config = K.default_config(m, n, split, sms=132)
    assert config[0] == want and config[2] == split
    assert config in K.CANDIDATES[split] and config in dict(K.DEFAULTS[split])


@pytest.mark.parametrize("m, n, k, want", [
    (8192, 4096, 4096, 256),    # short K: 8 waves of 256-wide tiles against 11 of 192
    (8192, 4096, 3072, 256), (6144, 2048, 4096, 256),  # (a tie of 3 x 256 and 4 x 192)
    (8192, 4096, 6144, 192),    # long K: the 0.96 model
    (8192, 16384, 4096, 192), (4096, 4096, 8192, 256)])
def test_default_config_short_k(m, n, k, want):
    """Split GEMMs with K <= SHORT_K take the 256-wide tile at its measured speed (1.0, ties
    to the wider tile); longer K and callers that give no K keep the 0.96 model."""
    from tecupy.kernels import fp8_gemm as K
    config = K.default_config(m, n, True, sms=132, k=k)
    assert config[0] == want and config in dict(K.DEFAULTS[True])
    assert K.default_config(8192, 4096, True, sms=132)[0] == 192  # (no K: as before)


@pytest.mark.parametrize("m, n, k, want", [
    (8192, 4096, 4096, (256, 256)), (8192, 12288, 4096, (256, 256)),  # short K: as split
    (8192, 4096, 16384, (256, 192)),  # long K: 128x128 B at 0.98, 1x128 B split's 0.96
    (4096, 8192, 16384, (256, 192)), (8192, 8192, 8192, (192, 192))])
def test_block_gemm_tile_follows_k(monkeypatch, m, n, k, want):
    """The block-scaled GEMM takes the per-tensor split GEMM's tile for its K: 256-wide at
    attention proj's 8192 x 4096 x 4096 (1.01-1.04x the 192-wide tile's median TFLOP/s on
    an H100, PERFLOG.md session 28); with longer K, B in 128x128 blocks (want[0]) takes the
    256-wide tile where its 0.98 speed makes it the cheaper (fc2's shape: 1.05-1.08x,
    session 31), B in 1x128 blocks (want[1]) split's model."""
    from tecupy.fp8 import E4M3
    from tecupy.kernels import block_scaling as B
    from tecupy.kernels import fp8_gemm as K
    monkeypatch.setattr(K, "sm_count", lambda: 132)
    monkeypatch.setattr(K, "_plan", lambda config, *args, **kwargs: config)
    for dim_b, bn in zip((2, 1), want):
        config, _ = B._gemm_plan(m, n, k, E4M3, E4M3, dim_b, np.float32, True, False, None)
        assert config == (bn, 3 if bn == 256 else 4, True, 1), dim_b
    assert K.default_config(m, n, True, sms=132, k=k)[0] == want[1]  # (per tensor: split's)
