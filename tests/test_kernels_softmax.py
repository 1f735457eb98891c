"""CUDA scaled masked softmax and backward against the float64 reference."""
import numpy as np
import pytest

import tecupy
from tecupy.kernels import softmax as softmax_kernels
from conftest import assert_within_2x_reference, f64, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 1), (2, 3, 7, 9), (4, 33, 1000), (2, 128, 2048),
                                   (3, 40, 256), (2, 9, 4096), (2, 5, 6144),
                                   (1000, 64, 64)], ids=str)
@pytest.mark.parametrize("masking", ["none", "mask", "causal", "both"])
@pytest.mark.parametrize("variant", list(softmax_kernels.FWD_VARIANTS))
def test_softmax(monkeypatch, rng, variant, dtype, shape, masking):
    """Every forward variant (scripts/issue3_device.py; block4 is what runs off Hopper) and
    the backward, block and three-pass kernels by shape; (1000, 64, 64) has more rows than
    the stream kernel's rings hold (mbarrier phases flip)."""
    monkeypatch.setattr(softmax_kernels, "FWD_VARIANT", variant)
    x = (rng.standard_normal(shape) * 4).astype(dtype)
    mask = None
    if masking in ("mask", "both"):  # broadcast over the leading axis; one row fully masked
        mask = rng.random((1,) + shape[1:]) < 0.3
        mask[(0,) * (len(shape) - 1)] = True
    causal = masking in ("causal", "both")
    scale = float(rng.uniform(0.1, 1.5))
    args = [x, scale, mask, causal]
    y = run("softmax_fwd", args, True)
    assert_within_2x_reference(y, run("softmax_fwd", f64(args), False),
                               run("softmax_fwd", args, False), "softmax fwd", atol=1e-6)
    dy = rng.standard_normal(shape).astype(dtype)
    y_ref = run("softmax_fwd", args, False)
    bargs = [dy, y_ref, scale]
    assert_within_2x_reference(run("softmax_bwd", bargs, True),
                               run("softmax_bwd", f64(bargs), False),
                               run("softmax_bwd", bargs, False), "softmax bwd", atol=1e-5)


@pytest.mark.parametrize("scale", [-0.7, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_scale_sign(rng, scale, causal):
    """The stream kernel takes max(x scale) as max(x) scale, so only scale >= 0; a negative
    scale runs another kernel, and scale 0 gives each row's kept entries equal weights."""
    x = (rng.standard_normal((2, 9, 4096)) * 4).astype(tecupy.bfloat16)
    args = [x, scale, None, causal]
    assert_within_2x_reference(run("softmax_fwd", args, True),
                               run("softmax_fwd", f64(args), False),
                               run("softmax_fwd", args, False), "softmax fwd", atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1, 1024), (2, 9, 4096), (3, 300, 2048), (1000, 64, 64)],
                         ids=str)
@pytest.mark.parametrize("masking", ["none", "both"])
def test_softmax_stream_rows_from_counters(monkeypatch, rng, shape, masking):
    """softmax_fwd_stream with its rows taken from counters (RowTaker) at every size, through
    a pool of 3 sets of counters, call after call: every row written once and right, and
    every counter left at zero."""
    import cupy
    from tecupy.kernels import launch, pools, ring
    if not launch.hopper():
        pytest.skip("softmax_fwd_stream runs on Hopper")
    monkeypatch.setattr(softmax_kernels, "FWD_VARIANT", "stream")
    monkeypatch.setattr(ring, "RING_DYNAMIC_ROWS", 0)
    monkeypatch.setattr(pools, "RING_SLOTS", 3)
    monkeypatch.setattr(pools, "_pools", {})
    for _ in range(4):
        x = (rng.standard_normal(shape) * 4).astype(tecupy.bfloat16)
        mask = rng.random((1,) + shape[1:]) < 0.3 if masking == "both" else None
        args = [x, 0.7, mask, masking == "both"]
        assert_within_2x_reference(run("softmax_fwd", args, True),
                                   run("softmax_fwd", f64(args), False),
                                   run("softmax_fwd", args, False), "softmax fwd", atol=1e-6)
    cupy.cuda.Device().synchronize()
    buf = pools._pools["ring", cupy.cuda.runtime.getDevice()][0]
    assert int(abs(buf).max()) == 0, "a row counter was not left at zero"
