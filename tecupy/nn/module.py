"""Module base: owns parameters (plain arrays) and child modules, and its FP8 state."""
import numpy as np

from .._array import FLOAT_DTYPES, gpu_available

INIT_STD = 0.023  # Transformer Engine's default init_method: normal(0, 0.023)


def resolve_device(device):
    """'cuda' (CuPy arrays), 'cpu' (NumPy arrays), or None: cuda when a GPU is present."""
    if device is None:
        return "cuda" if gpu_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda', 'cpu' or None, got {device!r}")
    if device == "cuda" and not gpu_available():
        raise RuntimeError("device='cuda' but CuPy sees no CUDA device; use device='cpu'")
    return device


def resolve_dtype(params_dtype):
    dtype = np.dtype(np.float32 if params_dtype is None else params_dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"params_dtype {dtype} is not accepted; use float16, bfloat16, "
                        "float32 or float64")
    return dtype


class Module:
    """Call runs `forward`. Parameters are attributes named in `_param_names`; child
    modules are attributes that are Modules. `training` switches dropout."""

    def __init__(self, params_dtype=None, device=None, seed=None):
        self._param_names = []
        self.training = True
        self.params_dtype = resolve_dtype(params_dtype)
        self.device = resolve_device(device)
        self.rng = np.random.default_rng(seed)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @property
    def xp(self):
        if self.device == "cuda":
            import cupy
            return cupy
        return np

    def _child_kwargs(self):
        seed = int(self.rng.integers(0, 2**63))
        return dict(params_dtype=self.params_dtype, device=self.device, seed=seed)

    def add_parameter(self, name, shape, init):
        """init: 'normal' (std 0.023), 'zeros' or 'ones'."""
        if init == "normal":
            host = self.rng.normal(0.0, INIT_STD, size=shape)
        else:
            host = (np.zeros if init == "zeros" else np.ones)(shape)
        setattr(self, name, self.xp.asarray(host.astype(self.params_dtype)))
        self._param_names.append(name)

    def named_parameters(self, prefix=""):
        out = {prefix + n: getattr(self, n) for n in self._param_names
               if getattr(self, n) is not None}
        for name, child in vars(self).items():
            if isinstance(child, Module):
                out.update(child.named_parameters(prefix + name + "."))
        return out

    def parameters(self):
        return list(self.named_parameters().values())

    def train(self, mode=True):
        self.training = bool(mode)
        for child in vars(self).values():
            if isinstance(child, Module):
                child.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def next_seed(self):
        """A fresh dropout seed from the module's own generator (reproducible from `seed`)."""
        return int(self.rng.integers(0, 2**63))
