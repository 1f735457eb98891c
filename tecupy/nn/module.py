"""Module base: owns parameters (plain arrays) and child modules, and its FP8 state."""
import copy

import numpy as np

from .. import _check
from .._array import FLOAT_DTYPES, gpu_available, to_numpy
from ..fp8_params import FP8Weight, active_init
from ..fp8_state import FP8State, check_array, mismatch
from ..graphs import draw_seed

INIT_STD = 0.023  # Transformer Engine's default init_method: normal(0, 0.023)


def resolve_device(op, device):
    """'cuda' (CuPy arrays), 'cpu' (NumPy arrays), or None: cuda when a GPU is present."""
    if device is None:
        return "cuda" if gpu_available() else "cpu"
    if not (isinstance(device, str) and device in ("cuda", "cpu")):
        _check.fail(op, "device", "'cuda', 'cpu' or None", device,
                    ValueError if isinstance(device, str) else TypeError)
    if device == "cuda" and not gpu_available():
        raise RuntimeError(f"{op}: device='cuda' but CuPy sees no CUDA device; use "
                           "device='cpu'")
    return device


def resolve_dtype(op, params_dtype):
    """None (float32) or a floating dtype; numpy's own "data type 'foo' not understood"
    names no argument, and an integer dtype would truncate the initial weights to 0."""
    try:
        dtype = np.dtype(np.float32 if params_dtype is None else params_dtype)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype not in FLOAT_DTYPES:  # (np.dtype("f8") == None is True)
        _check.fail(op, "params_dtype", "None or a floating dtype (float16, bfloat16, "
                    "float32, float64)", params_dtype, TypeError)
    return dtype


class Module:
    """Call runs `forward`. Parameters are attributes named in `_param_names`; child
    modules are attributes that are Modules. `training` switches dropout."""

    def __init__(self, params_dtype=None, device=None, seed=None):
        self._param_names = []
        self.training = True
        op = type(self).__name__
        self.params_dtype = resolve_dtype(op, params_dtype)
        self.device = resolve_device(op, device)
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

    def quantize_weights(self, *weights):
        """Under quantized_model_init: each (parameter name, GEMM index of self.fp8_state)
        becomes an FP8Weight (cast with the init's recipe); otherwise nothing."""
        init = active_init()
        if init is None:
            return
        recipe, preserve = init
        for name, gemm in weights:
            setattr(self, name, FP8Weight(getattr(self, name), recipe, self.fp8_state, gemm,
                                          preserve))

    def named_parameters(self, prefix=""):
        out = {}
        self._named_parameters(prefix, out)
        return out

    def _named_parameters(self, prefix, out):
        """named_parameters into `out`, children's after this module's own, in attribute
        order (one dict for the whole tree: a training loop asks for it every step)."""
        for n in self._param_names:
            p = getattr(self, n)
            if p is not None:
                out[prefix + n] = p
        for name, child in vars(self).items():
            if isinstance(child, Module):
                child._named_parameters(prefix + name + ".", out)

    def parameters(self):
        return list(self.named_parameters().values())

    def named_modules(self, prefix=""):
        """(prefix, module) for this module (prefix "") and every descendant ("child.")."""
        yield prefix, self
        for name, child in vars(self).items():
            if isinstance(child, Module):
                yield from child.named_modules(prefix + name + ".")

    def _fp8_states(self):
        """(key prefix, FP8State) for every FP8State attribute of this module and below."""
        for prefix, module in self.named_modules():
            for name, state in vars(module).items():
                if isinstance(state, FP8State):
                    yield prefix + name + ".", state

    def state_dict(self):
        """Everything a bit-identical continuation needs, as a plain dict of numpy arrays
        and python values (copies; pickles as it is). Keys, with module paths as in
        named_parameters ("self_attention.proj.weight"):
          <parameter name>                  every parameter, a numpy array of its dtype;
                                            an FP8Weight's codes (uint8), with
          <parameter name>.scale_inv        float32 [1] (quantized_model_init), or one per
                                            128x128 block [ceil(out/128), ceil(in/128)]
                                            (under Float8BlockScaling)
          <module.>rng_state                every module's numpy Generator state (a dict:
                                            bit_generator.state); dropout seeds come from it
          <module.>fp8_state.fp8_format     "HYBRID" | "E4M3", or None: never used in FP8
          <module.>fp8_state.amax_history_len   int (None when never used)
          <module.>fp8_state.{fwd,bwd}.{scale,scale_inv,amax_history}
                                            float32 [3n] / [2n], history [L, 3n] / [L, 2n]
                                            for n GEMMs (only when used)
        """
        sd = {}
        for name, p in self.named_parameters().items():
            if isinstance(p, FP8Weight):  # its codes and scale_inv (the master: optimizer's)
                sd[name] = np.array(to_numpy(p.data))  # (copies, as for the others)
                sd[name + ".scale_inv"] = np.array(to_numpy(p.scale_inv))
            else:
                sd[name] = np.array(to_numpy(p))
        for prefix, module in self.named_modules():
            sd[prefix + "rng_state"] = copy.deepcopy(module.rng.bit_generator.state)
        for prefix, state in self._fp8_states():
            sd.update(state.state_dict(prefix))
        return sd

    def load_state_dict(self, state_dict):
        """Restore what state_dict gave, onto this module's device; parameters are written
        in place (references to them stay valid). Every key is checked first: a missing or
        unexpected key, or a shape, dtype, FP8 format or history length other than this
        module's, is a ValueError listing each (key, got, expected), and nothing is loaded.
        An FP8 state not yet used here takes the saved format and history length."""
        keys, errors = self._check_state_dict(state_dict)
        errors += [mismatch(k, "an unexpected key", f"only the keys of {type(self).__name__}"
                            ".state_dict()") for k in sorted(set(state_dict) - set(keys))]
        if errors:
            raise ValueError(f"{type(self).__name__}.load_state_dict: nothing was loaded; "
                             f"{len(errors)} mismatch(es):\n  " + "\n  ".join(errors))
        xp = self.xp
        for name, p in self.named_parameters().items():
            if isinstance(p, FP8Weight):
                p.load(state_dict[name], state_dict[name + ".scale_inv"])
            else:
                p[...] = xp.asarray(state_dict[name])
        for prefix, module in self.named_modules():
            module.rng.bit_generator.state = copy.deepcopy(state_dict[prefix + "rng_state"])
        for prefix, state in self._fp8_states():
            state.load_state_dict(state_dict, prefix, xp)
        return self

    def _check_state_dict(self, sd):
        """(the keys this module loads, the errors loading sd would meet)."""
        keys, errors = [], []
        for name, p in self.named_parameters().items():
            keys.append(name)
            if isinstance(p, FP8Weight):
                keys.append(name + ".scale_inv")
                errors += check_array(sd, name, p.shape, np.dtype(np.uint8))
                errors += check_array(sd, name + ".scale_inv", tuple(p.scale_inv.shape),
                                      np.dtype(np.float32))
            else:
                errors += check_array(sd, name, p.shape, p.dtype)
        for prefix, module in self.named_modules():
            keys.append(prefix + "rng_state")
            errors += _check_rng(sd, prefix + "rng_state", module.rng)
        for prefix, state in self._fp8_states():
            k, e = state.check_state_dict(sd, prefix)
            keys, errors = keys + k, errors + e
        return keys, errors

    def train(self, mode=True):
        """Training mode on (dropout active) or off; mode is a bool ("no" would be truthy)."""
        self.training = _check.flag(f"{type(self).__name__}.train", "mode", mode)
        for child in vars(self).values():
            if isinstance(child, Module):
                child.train(self.training)
        return self

    def eval(self):
        return self.train(False)

    def next_seed(self):
        """A fresh dropout seed from the module's own generator (reproducible from `seed`;
        drawn again before each replay of a captured step: graphs.draw_seed)."""
        return draw_seed(self._draw_seed)

    def _draw_seed(self):
        return int(self.rng.integers(0, 2**63))


def _check_rng(sd, key, rng):
    """[] when sd[key] is a state this generator takes (tried on a scratch generator of the
    same kind, so a bad one fails here, not halfway through loading), else [the error]."""
    kind = type(rng.bit_generator).__name__
    if key not in sd:
        return [mismatch(key, "missing", f"a {kind} bit_generator.state dict")]
    try:
        type(rng.bit_generator)().state = sd[key]
    except (TypeError, ValueError, KeyError) as e:
        return [mismatch(key, f"{sd[key]!r:.80} ({e})", f"a {kind} bit_generator.state dict")]
    return []
