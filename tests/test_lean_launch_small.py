"""The lean eager path (issue 21) of the small kernels, no GPU needed: the dbias column sums
(both stages), scale_inverse and fp8_transpose launch through a Launcher kept in a launch
plan, and dbias comes in its own type from the sums' kernel (no astype launch). Kernel
lookups and cuLaunchKernelEx are faked (tests/test_host_path.py's fixtures)."""
import struct

import numpy as np
import pytest

import tecupy
from tecupy.fp8 import E4M3
from tecupy.kernels import cast as cast_kernels
from tecupy.kernels import colsum as colsum_kernels
from tecupy.kernels import scaling as scaling_kernels
from tecupy.kernels import transpose as transpose_kernels
from test_host_path import FakeArray, fake_cupy, fake_driver  # noqa: F401 (fixtures)


@pytest.fixture
def launches(fake_cupy, fake_driver, monkeypatch):  # noqa: F811 (fixtures)
    """Fresh plans, no astype (a launch of its own on a GPU); returns launches() -> [(kernel
    name, grid, block, PDL attributes, packed argument bytes)] so far."""
    for module in (cast_kernels, colsum_kernels, transpose_kernels):
        monkeypatch.setattr(module, "_plans", {})
    monkeypatch.setattr(scaling_kernels, "_inverse_plans", {})
    monkeypatch.setattr(cast_kernels, "sm_count", lambda: 132)
    monkeypatch.setattr(cast_kernels, "resident_blocks", lambda k, threads, smem: 4)

    def astype(self, dtype, copy=True):
        raise AssertionError("astype: a CuPy launch of its own")
    monkeypatch.setattr(FakeArray, "astype", astype)

    def launched():
        names = {k.kernel.ptr: name for name, k in fake_cupy.items()}
        assert all(not k.calls for k in fake_cupy.values())  # (none through CuPy's launch)
        return [(names[f], grid, block, pdl, raw)
                for grid, block, _, f, raw, pdl, _ in fake_driver]
    return launched


def _unpack(raw, fmt):
    return struct.unpack_from("<" + fmt, raw)


@pytest.mark.parametrize("dtype,name", [
    (tecupy.bfloat16, "__nv_bfloat16"), (np.dtype(np.float16), "__half"),
    (np.dtype(np.float32), "float"), (np.dtype(np.float64), "double")])
def test_dbias_is_written_in_its_type_by_the_sums_kernel(launches, dtype, name):
    """dbias of [600, 70] bf16: 2 splits of 300 rows into float32 partials, then their sums
    written in the caller's type by col_sum<float, T>, both with PDL; a second call plans
    nothing (the kernels looked up once)."""
    dy = FakeArray((600, 70), tecupy.bfloat16)
    for _ in range(2):
        before = len(FakeArray.made)
        db = colsum_kernels.dbias(dy, dtype)
        part = FakeArray.made[before]
        assert (part.shape, part.dtype) == ((2, 70), np.float32)
        assert (db.shape, db.dtype) == ((70,), dtype) and FakeArray.made[before:] == [part, db]
    assert len(colsum_kernels._plans) == 2
    first, second = launches()[-2:]
    assert first[:4] == ("col_sum<__nv_bfloat16, float>", (3, 2, 1), (32, 8, 1), 1)
    assert _unpack(first[4], "QQqi4xq") == (dy.data.ptr, part.data.ptr, 600, 70, 300)
    assert second[:4] == (f"col_sum<float, {name}>", (3, 1, 1), (32, 8, 1), 1)
    assert _unpack(second[4], "QQqi4xq") == (part.data.ptr, db.data.ptr, 2, 70, 2)


def test_the_stages_plan_apart(launches):
    """A first stage of 2 rows and a second of 2 splits of one width and type: two plans."""
    colsum_kernels.col_sum(FakeArray((2, 70), np.float32), np.dtype(np.float32))
    colsum_kernels.dbias(FakeArray((2, 70), np.float32))
    assert [r[0] for r in launches()] == ["col_sum<float, float>"] * 3
    assert [r[1] for r in launches()] == [(3, 1, 1)] * 3
    assert [_unpack(r[4], "16xqi4xq") for r in launches()] == [(2, 70, 2), (2, 70, 2),
                                                              (1, 70, 1)]


def test_col_sum_of_another_type_casts_the_float32_sums(launches, monkeypatch):
    """An output type the kernel is not built for (none of the float types): the float32
    sums, then astype."""
    monkeypatch.setattr(FakeArray, "astype", lambda self, dtype: FakeArray(self.shape, dtype))
    got = colsum_kernels.col_sum(FakeArray((3, 40), np.float32), np.dtype(np.int32))
    assert (got.shape, got.dtype) == ((40,), np.int32)
    assert [r[0] for r in launches()] == ["col_sum<float, float>"]


def test_bias_grad_sums_into_the_bias_type(launches):
    got = colsum_kernels.bias_grad(FakeArray((512, 16), np.float16), tecupy.bfloat16)
    assert (got.shape, got.dtype) == ((16,), tecupy.bfloat16)
    assert [r[0] for r in launches()] == ["col_sum<__half, float>",
                                          "col_sum<float, __nv_bfloat16>"]


def test_cast_transpose_dbias_sums_its_partials_into_dbias(launches):
    """cast_transpose_dbias: the cast kernel writes one float32 partial row per 128 rows,
    col_sum<float, bf16> sums them into dbias; the cast's arguments from its plan (ld =
    cols, no activation) as the general path packs them."""
    x = FakeArray((256, 4096), tecupy.bfloat16)
    scale, amax, inv = (FakeArray((1,), np.float32) for _ in range(3))
    before = len(FakeArray.made)
    q, qt, got_amax, db = cast_kernels.cast_transpose_dbias(x, scale, E4M3, tecupy.bfloat16,
                                                            amax, inv)
    part = FakeArray.made[before + 2]
    assert (part.shape, part.dtype) == ((2, 4096), np.float32) and got_amax is amax
    assert (db.shape, db.dtype) == ((4096,), tecupy.bfloat16)
    (cast_name, _, _, _, raw), (sum_name, grid, _, _, sums) = launches()
    assert cast_name.startswith("cast_transpose_tiled<__nv_bfloat16, __nv_fp8_e4m3, 1, true")
    assert _unpack(raw, "Q" * 8 + "i4xi4xQQqq") == (
        x.data.ptr, scale.data.ptr, q.data.ptr, qt.data.ptr, inv.data.ptr, amax.data.ptr, 0,
        part.data.ptr, 256, 4096, 0, 0, 4096, 4096)
    assert (sum_name, grid) == ("col_sum<float, __nv_bfloat16>", (128, 1, 1))
    assert _unpack(sums, "QQqi4xq") == (part.data.ptr, db.data.ptr, 2, 4096, 2)


def test_fp8_transpose_launches_its_plan(launches):
    data = FakeArray((48, 160), np.uint8)
    for _ in range(2):
        out = transpose_kernels.fp8_transpose(data)
    assert (out.shape, out.dtype) == ((160, 48), np.uint8)
    assert len(transpose_kernels._plans) == 1
    name, grid, block, pdl, raw = launches()[-1]
    assert (name, grid, block, pdl) == ("transpose_u8", (3, 1, 1), (256, 1, 1), 1)
    assert _unpack(raw, "QQi4xi4x") == (data.data.ptr, out.data.ptr, 48, 160)


def test_scale_inverse_launches_its_plan(launches):
    scale, out = FakeArray((300,), np.float32), FakeArray((300,), np.float32)
    for _ in range(2):
        scaling_kernels.scale_inverse(scale, out)
    assert len(scaling_kernels._inverse_plans) == 1
    name, grid, block, pdl, raw = launches()[-1]
    assert (name, grid, block, pdl) == ("scale_inverse", (3, 1, 1), (128, 1, 1), 1)
    assert _unpack(raw, "QQi4x") == (scale.data.ptr, out.data.ptr, 300)
