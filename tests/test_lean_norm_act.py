"""The norms' and activations' CUDA wrappers through kept launch plans (issue 21), no GPU
needed: CuPy faked (test_host_path.fake_launches), every launch recorded. A call packs the
same kernels, grids and arguments as the wrappers did before their plans (GOLDEN: recorded
from them), and a second call of a shape plans nothing."""
import contextlib
import itertools
import struct

import numpy as np
import pytest

import tecupy
from tecupy import backends, loader
from tecupy.fp8 import E4M3, E5M2
from tecupy.kernels import activation as act_kernels
from tecupy.kernels import norm as norm_kernels
from tecupy.kernels import pools, ring
from test_host_path import fake_launches, numbered

BF16, F16, F32 = tecupy.bfloat16, np.dtype(np.float16), np.dtype(np.float32)


def _cuda(op):
    """The cuda implementation registered for `op` (called without dispatch's choice)."""
    return next(i.fn for i in backends._registry[op] if i.kind == "cuda")


def _args(cupy, case):
    """The call of `case` (op, shapes and settings) on fake arrays."""
    op, shape, dtype, kw = case
    hidden = shape[-1]
    x = cupy.empty(shape, dtype)
    g, b, one = cupy.empty((hidden,), dtype), cupy.empty((hidden,), dtype), cupy.empty(1, F32)
    amax = cupy.empty(1, F32) if kw.get("amax_out") else None
    fmt = kw.get("fmt")
    if op.startswith(("layernorm_fwd", "rmsnorm_fwd")):
        head = (x, g) if op.startswith("rms") else (x, g, b)
        tail = (kw.get("eps", 1e-5), kw.get("zc", False))
        return head + tail + ((one, fmt, amax) if op.endswith("fp8") else ())
    if op.endswith("norm_bwd"):
        dres = cupy.empty(shape, dtype) if kw.get("dres") else None
        rsigma = cupy.empty(shape[:-1], F32)
        mid = (rsigma,) if op.startswith("rms") else (cupy.empty(shape[:-1], F32), rsigma)
        return (cupy.empty(shape, dtype), x) + mid + (g, kw.get("zc", False), dres)
    gated = op.startswith(("swiglu", "geglu"))
    bias = cupy.empty((hidden // 2 if gated else hidden,), dtype) if kw.get("bias") else None
    if op.endswith("_fwd"):
        return (x, bias) + ((one, fmt, amax) if fmt else ())
    out = cupy.empty(shape, dtype) if kw.get("out") else None
    return cupy.empty(shape, dtype), x, bias, out


CASES = {  # name: (op, shape, dtype, settings: call keywords and module settings)
    "ln_fp8_stream": ("layernorm_fwd_fp8", (256, 4096), BF16, {"fmt": E4M3, "amax_out": 1}),
    "ln_fp8_warp_3d": ("layernorm_fwd_fp8", (3, 5, 1024), BF16, {"fmt": E5M2}),
    "ln_fp8_setting": ("layernorm_fwd_fp8", (256, 4096), BF16,
                       {"fmt": E4M3, "amax_out": 1, "FWD_VARIANT": "warp"}),
    "ln_counted": ("layernorm_fwd", (20000, 4096), BF16, {"eps": 1e-6}),
    "ln_block_odd": ("layernorm_fwd", (7, 1001), F16, {"zc": True}),
    "ln_block_wide": ("layernorm_fwd", (9, 24576), BF16, {}),
    "rms_fp8_zc": ("rmsnorm_fwd_fp8", (300, 4096), BF16, {"fmt": E4M3, "zc": True,
                                                          "amax_out": 1}),
    "rms_fp32": ("rmsnorm_fwd", (33, 768), F32, {}),
    "ln_bwd_grp": ("layernorm_bwd", (256, 4096), BF16, {"dres": True}),
    "ln_bwd_ring4": ("layernorm_bwd", (256, 4096), BF16, {"BWD_VARIANT": "ring4"}),
    "rms_bwd_3d": ("rmsnorm_bwd", (3, 5, 1024), BF16, {"zc": True}),
    "ln_bwd_odd": ("layernorm_bwd", (7, 1001), F16, {"dres": True}),
    "ln_bwd_wide": ("layernorm_bwd", (9, 24576), BF16, {}),
    "gelu_fp8_bias": ("gelu_fwd", (256, 16384), BF16, {"bias": 1, "fmt": E4M3, "amax_out": 1}),
    "gelu_odd_3d": ("gelu_fwd", (3, 5, 100), BF16, {}),
    "relu_fp8_pool": ("relu_fwd", (64, 512), F16, {"fmt": E5M2}),
    "swiglu_fp8": ("swiglu_fwd", (128, 2048), BF16, {"bias": 1, "fmt": E4M3, "amax_out": 1}),
    "geglu_f32": ("geglu_fwd", (5, 6), F32, {}),
    "gelu_bwd_bias_out": ("gelu_bwd", (256, 16384), BF16, {"bias": 1, "out": 1}),
    "gelu_bwd_3d": ("gelu_bwd", (3, 5, 100), BF16, {}),
    "swiglu_bwd_bias": ("swiglu_bwd", (128, 2048), BF16, {"bias": 1}),
}


@contextlib.contextmanager
def _recording(monkeypatch):
    """fake_launches, with the norm and activation plans fresh, occupancy faked where the
    norms' ring launches ask for it and the pools' slots as numbered fake addresses: yields
    (the fake cupy, the launches, the kernels looked up)."""
    with fake_launches(monkeypatch, True) as (host, cupy, launched):
        for module in (norm_kernels, act_kernels):
            monkeypatch.setattr(module, "_plans", {})
        for module in (norm_kernels, ring):
            monkeypatch.setattr(module, "resident_blocks", lambda k, threads, smem: 2)
        slots = itertools.count(3 << 40, 1 << 12)
        monkeypatch.setattr(pools, "_pool_slot", lambda kind, n, words: np.uint64(next(slots)))
        # set and put back here, not by monkeypatch, whose undo (after FakeCupy's exit) would
        # leave FakeCupy's stand-ins in place of the real ones
        contiguous, function, looked_up = cupy.ascontiguousarray, loader.function, []
        cupy.ascontiguousarray = lambda a, dtype=None: a if dtype in (None, a.dtype) else \
            a.astype(dtype)  # (FakeCupy's takes no dtype: the norms give one)
        loader.function = lambda *a, **kw: looked_up.append(a[1]) or function(*a, **kw)
        try:
            yield cupy, launched, looked_up
        finally:
            cupy.ascontiguousarray, loader.function = contiguous, function


def _record(monkeypatch, name, calls=1):
    """Per call of `calls` calls of CASES[name]: its launches (_ours), and the kernels it
    looked up."""
    op, shape, dtype, kw = case = CASES[name]
    with _recording(monkeypatch) as (cupy, launched, looked_up):
        for setting in ("FWD_VARIANT", "BWD_VARIANT"):
            if setting in kw:
                monkeypatch.setattr(norm_kernels, setting, kw[setting])
        out = []
        for _ in range(calls):
            del launched[:], looked_up[:]
            _cuda(op)(*_args(cupy, case))
            out.append((_ours(launched), [k for k in looked_up if k.startswith(_OURS)]))
        return out


_OURS = ("norm_", "act_", "gated_")  # this module's kernels


def _ours(launched):
    """The launches of this module's kernels (dbias's column sums left to their own tests),
    addresses numbered, grids and blocks as given to the kernel."""
    return [(f, grid[0], block[:2], shared, args) for f, grid, block, shared, args in
            numbered([r for r in launched if r[0].startswith(_OURS)])]


# CASES' launches recorded from the wrappers before their plans (commit 9a3a9e7; the norm
# forwards' scale_inv pointer after the slot added since, null in these calls): kernel,
# grid, block, shared bytes, arguments (addresses numbered; 925353388 and 897988541: eps
# 1e-5 and 1e-6 as float32 bits)
GOLDEN = {
    "ln_fp8_stream": [
        ("norm_fwd_stream<__nv_bfloat16, 8, false, __nv_fp8_e4m3, 2, __nv_bfloat16>", 32, (512, 1),
         148608, [0, 1, 2, 3, 4, 5, 256, 4096, 925353388, 0, 6, 7, 0, 0, 0, 2])],
    "ln_fp8_warp_3d": [
        ("norm_fwd_warp<__nv_bfloat16, 8, 4, false, __nv_fp8_e5m2>", 4, (128, 1), 0, [0, 1, 2, 3,
         4, 5, 15, 1024, 925353388, 0, 6, 7, 8, 0])],
    "ln_fp8_setting": [
        ("norm_fwd_warp<__nv_bfloat16, 8, 16, false, __nv_fp8_e4m3>", 64, (128, 1), 0, [0, 1, 2,
         3, 4, 5, 256, 4096, 925353388, 0, 6, 7, 0, 0])],
    "ln_counted": [
        ("norm_fwd_stream<__nv_bfloat16, 8, false, __nv_bfloat16, 4, __nv_bfloat16>", 264,
         (512, 1), 83072, [0, 1, 2, 3, 4, 5, 20000, 4096, 897988541, 0, 3, 3, 3, 0, 6, 2])],
    "ln_block_odd": [
        ("norm_fwd<__half, 1, 2, false, __half>", 7, (512, 1), 0, [0, 1, 2, 3, 4, 5, 7, 1001,
         925353388, 1, 3, 3, 3, 0])],
    "ln_block_wide": [
        ("norm_fwd<__nv_bfloat16, 8, 8, false, __nv_bfloat16>", 9, (384, 1), 0, [0, 1, 2, 3, 4, 5,
         9, 24576, 925353388, 0, 3, 3, 3, 0])],
    "rms_fp8_zc": [
        ("norm_fwd_stream<__nv_bfloat16, 8, true, __nv_fp8_e4m3, 2, float>", 38, (512, 1), 148608,
         [0, 1, 1, 2, 3, 4, 300, 4096, 925353388, 1, 5, 6, 0, 0, 0, 2])],
    "rms_fp32": [
        ("norm_fwd_warp<float, 4, 8, true, float>", 9, (128, 1), 0, [0, 1, 1, 2, 3, 4, 33, 768,
         925353388, 0, 2, 2, 2, 0])],
    "ln_bwd_grp": [
        ("norm_bwd_grp<__nv_bfloat16, 8, 2, false, 3, 2>", 128, (512, 1), 98432, [0, 1, 2, 3, 4, 5,
         6, 7, 256, 4096, 0]),
        ("norm_bwd_reduce_vec<__nv_bfloat16>", 64, (32, 32), 0, [7, 128, 4096, 8, 9, 1])],
    "ln_bwd_ring4": [
        ("norm_bwd_ring<__nv_bfloat16, 8, 2, false, 4>", 256, (256, 1), 65536, [0, 1, 2, 3, 4, 5,
         0, 6, 256, 4096, 0]),
        ("norm_bwd_reduce_vec<__nv_bfloat16>", 64, (32, 32), 0, [6, 256, 4096, 7, 8, 1])],
    "rms_bwd_3d": [
        ("norm_bwd_grp<__nv_bfloat16, 8, 1, true, 3, 8>", 2, (1024, 1), 98560, [0, 1, 2, 2, 3, 4,
         0, 5, 15, 1024, 1]),
        ("norm_bwd_reduce_vec<__nv_bfloat16>", 16, (32, 32), 0, [5, 2, 1024, 6, 6, 0])],
    "ln_bwd_odd": [
        ("norm_bwd<__half, 1, 2, false, false, 2>", 7, (512, 1), 0, [0, 1, 2, 3, 4, 5, 6, 7, 7,
         1001, 0]),
        ("norm_bwd_reduce<__half>", 63, (32, 8), 0, [7, 7, 1001, 8, 9, 1])],
    "ln_bwd_wide": [
        ("norm_bwd<__nv_bfloat16, 8, 8, false, true, 1>", 9, (384, 1), 196608, [0, 1, 2, 3, 4, 5,
         0, 6, 9, 24576, 0]),
        ("norm_bwd_reduce_vec<__nv_bfloat16>", 384, (32, 32), 0, [6, 9, 24576, 7, 8, 1])],
    "gelu_fp8_bias": [
        ("act_fwd<__nv_bfloat16, 8, Gelu, __nv_fp8_e4m3, true>", 1056, (256, 1), 0, [0, 1, 2,
         4194304, 16384, 3, 4, 0])],
    "gelu_odd_3d": [
        ("act_fwd<__nv_bfloat16, 1, Gelu, __nv_bfloat16, false>", 6, (256, 1), 0, [0, 0, 1, 1500,
         100, 1, 1, 1])],
    "relu_fp8_pool": [
        ("act_fwd<__half, 8, Relu, __nv_fp8_e5m2, false>", 16, (256, 1), 0, [0, 0, 1, 32768, 512,
         2, 3, 4])],
    "swiglu_fp8": [
        ("gated_fwd<__nv_bfloat16, 8, Silu, __nv_fp8_e4m3, true>", 64, (256, 1), 0, [0, 1, 2, 128,
         1024, 3, 4, 0])],
    "geglu_f32": [
        ("gated_fwd<float, 1, Gelu, float, false>", 1, (256, 1), 0, [0, 0, 1, 5, 3, 1, 1, 1])],
    "gelu_bwd_bias_out": [
        ("act_bwd<__nv_bfloat16, 8, Gelu, true>", 2048, (256, 1), 0, [0, 1, 2, 3, 4194304,
         16384])],
    "gelu_bwd_3d": [
        ("act_bwd<__nv_bfloat16, 1, Gelu, false>", 6, (256, 1), 0, [0, 1, 1, 2, 1500, 100])],
    "swiglu_bwd_bias": [
        ("gated_bwd<__nv_bfloat16, 8, Silu, true>", 64, (256, 1), 0, [0, 1, 2, 3, 128, 1024])],
}


@pytest.mark.parametrize("name", list(CASES))
def test_launches_are_the_ones_before_the_plans(monkeypatch, name):
    """Every call launches the kernels, grids and arguments the wrappers launched before
    their plans (the same bits on a GPU); the first call looks its kernels up, the second
    none (its plan kept)."""
    (first, looked_up), (second, again) = _record(monkeypatch, name, calls=2)
    assert first == second == GOLDEN[name]
    assert looked_up == [k[0] for k in first] and again == []


def test_counted_rings_take_new_counters_per_launch(monkeypatch):
    """Rows taken from counters (a forward's ring at many rows): each launch gets a zeroed
    set of its own from the pool, the plan kept."""
    with _recording(monkeypatch) as (cupy, launched, _):
        args = _args(cupy, CASES["ln_counted"])
        for _ in range(2):
            _cuda("layernorm_fwd")(*args)
    counters = [struct.unpack_from("<16Q", r[4])[14] for r in launched]
    assert counters[0] != counters[1] and all(c >= 3 << 40 for c in counters)


def test_a_changed_setting_gets_a_plan_of_its_own(monkeypatch):
    """FWD_VARIANT changed between calls of one shape (as tests and tuning scripts change
    it): each value its own kernel, and the first plan again when it is set back."""
    kernels, plans = [], []
    with _recording(monkeypatch) as (cupy, launched, _):
        args = _args(cupy, CASES["ln_fp8_stream"])
        for variant in ("stream", "warp", "stream"):
            monkeypatch.setattr(norm_kernels, "FWD_VARIANT", variant)
            _cuda("layernorm_fwd_fp8")(*args)
            kernels.append(launched[-1][0].split("<")[0])
            plans.append(len(norm_kernels._plans))
    assert kernels == ["norm_fwd_stream", "norm_fwd_warp", "norm_fwd_stream"]
    assert plans[0] < plans[1] == plans[2]


def test_fwd_launch_is_the_choice_the_plan_launches(monkeypatch):
    """_fwd_launch (test_launch.py reads it on a GPU) gives the choice: partial(launch, k)
    for the warp kernel, ring_launch's run for the stream kernel, each kept."""
    with _recording(monkeypatch):
        for variant in ("warp", "stream"):
            monkeypatch.setattr(norm_kernels, "FWD_VARIANT", variant)
            plan = norm_kernels._fwd_launch(300, 4096, BF16, None, False, False)
            assert norm_kernels._fwd_launch(300, 4096, BF16, None, False, False) is plan
            warp = getattr(plan[0], "args", [None])[0]
            assert getattr(warp, "name", "").startswith("norm_fwd_warp") == (variant == "warp")


def test_bwd_reduce_alone_launches_what_the_backward_does(monkeypatch):
    """_bwd_reduce (scripts/issue3_device.py times it alone) packs the backward's reduce."""
    with _recording(monkeypatch) as (cupy, launched, _):
        args = _args(cupy, CASES["ln_bwd_odd"])
        dx, dgamma, dbeta = _cuda("layernorm_bwd")(*args)
        part = cupy.empty((7, 2 * 1001), F32)
        norm_kernels._bwd_reduce(part, 7, 1001, dgamma, dbeta, False)
        a, b = launched[-2:]
    assert a[:4] == b[:4] and a[4][8:] == b[4][8:]  # (all but the partials' address)
