"""The activation table (tecupy/activation_table.py) is the one list of activations: every
row is an op with both backends, the op's names come from it, and its CUDA struct exists
and is instantiated; the FP8 GEMM's gelu epilogue uses act_math.cuh's, not a copy."""
import re

import pytest

from tecupy import backends, loader
from tecupy.activation_table import TABLE
from tecupy.kernels import activation as kernels
from tecupy.ops.activation import ACTIVATIONS, GATED


def test_op_names_come_from_the_table():
    assert ACTIVATIONS == tuple(TABLE)
    assert GATED == tuple(n for n in TABLE if TABLE[n].gated)


@pytest.mark.parametrize("name", list(TABLE))
def test_every_row_is_an_op_of_both_backends(name):
    for op in (f"{name}_fwd", f"{name}_bwd"):
        kinds = {kind for kind, _ in backends.registered()[op]}
        assert {"reference", "cuda"} <= kinds, op


@pytest.mark.parametrize("name", list(TABLE))
def test_every_row_has_its_cuda_struct_instantiated(name):
    row = TABLE[name]
    maths = (loader.cuda_dir() / "act_math.cuh").read_text()
    assert re.search(rf"^struct {row.cuda} {{", maths, re.M), row.cuda
    kind = "gated" if row.gated else "act"
    declared = loader.declared()[kernels.FILE]
    for op in ("fwd", "bwd"):
        assert any(n.startswith(f"{kind}_{op}<") and f", {row.cuda}, " in n for n in declared)


def test_gemm_gelu_epilogue_is_the_shared_one():
    gemm = (loader.templates_dir() / "fp8_gemm.cu").read_text()
    assert '#include "act_math.cuh"' in gemm
    assert "Gelu::f<false>" in gemm and "tanhf(" not in gemm
