"""CUDA activations (plain and gated), forward and backward, against the float64 reference."""
import numpy as np
import pytest

import tecupy
from conftest import assert_within_2x_reference, f64, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["gelu", "relu", "swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 2), (37, 1002), (257, 4096), (3, 5, 7, 18)], ids=str)
def test_activation(rng, name, dtype, shape):
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    gated = name in ("swiglu", "geglu")
    out_shape = shape[:-1] + (shape[-1] // 2,) if gated else shape
    dy = rng.standard_normal(out_shape).astype(dtype)
    got = run(f"{name}_fwd", [x], True)
    assert_within_2x_reference(got, run(f"{name}_fwd", f64([x]), False),
                               run(f"{name}_fwd", [x], False), f"{name} fwd")
    gotb = run(f"{name}_bwd", [dy, x], True)
    assert_within_2x_reference(gotb, run(f"{name}_bwd", f64([dy, x]), False),
                               run(f"{name}_bwd", [dy, x], False), f"{name} bwd", atol=1e-5)
