"""Checkpoints: `tecupy.save(path, module, optimizer=None, extra=None)` writes everything a
bit-identical continuation of a run needs; `tecupy.load(path, module, optimizer=None)`
restores it and returns `extra`.

What is saved: `module.state_dict()` (every parameter, every module's numpy Generator state,
every FP8State: format, history length, scale, scale_inv and amax_history of each slot;
Module.state_dict documents the keys), `optimizer.state_dict()` when an optimizer is given
(any object with state_dict / load_state_dict: a flat dict {str: numpy array | int | float
| str | bool | None | list | dict}), and `extra`, a dict of JSON values (step, data loader
position, tokenizer vocab, ...).

File format, version 1: one uncompressed `.npz` (a zip of `.npy` files, numpy's own format;
read with numpy.load(path, allow_pickle=False), no pickle anywhere). The path is used as
given (no ".npz" is appended). Entries:

  "__tecupy__"        uint8 [n]: UTF-8 JSON, the header (below)
  "module/<key>"      each numpy-array value of module.state_dict(), by its key
  "optimizer/<key>"   each numpy-array value of optimizer.state_dict(), by its key

The header is a JSON object (Python's json: integers of any size; NaN and Infinity as
written by json.dumps):

  {"format": "tecupy-checkpoint", "version": 1,
   "tecupy_version": "0.1.0", "module_type": "TransformerLayer",   (informational)
   "module": {<key>: <value>},      every non-array value of module.state_dict()
   "optimizer": {<key>: <value>} | null,     the same for the optimizer; null: none saved
   "extra": {<key>: <value>},       what save() was given ({} for None)
   "views": {<entry>: <dtype name>}}

Arrays of ml_dtypes types (bfloat16, float8_e4m3fn, ...), which .npy cannot describe
portably, are stored as a view of the unsigned integer of the same size (uint16 for
bfloat16) and `views` names the entry's real dtype; load views them back, bit for bit.
Non-array values are JSON as they are; numpy scalars become Python numbers, tuples become
lists, and a numpy array nested inside a value (a Generator state other than PCG64's) is
{"__ndarray__": nested list, "dtype": dtype.str}.

The file is written to a temporary file beside `path`, flushed to disk, then renamed over
`path`: a crash never leaves a half-written checkpoint under the name.

load() reads and checks everything before it changes anything: a file that is not a
tecupy checkpoint, a missing or other format version, or a state that does not fit the
module (missing or unexpected keys, shapes, dtypes, FP8 format or history length) or the
optimizer is a ValueError that names the keys, and nothing is loaded.
"""
import contextlib
import json
import os
import uuid
import zipfile

import ml_dtypes
import numpy as np

from ._array import to_numpy

FORMAT = "tecupy-checkpoint"
VERSION = 1
HEADER = "__tecupy__"
SECTIONS = ("module", "optimizer")


# ---- save -------------------------------------------------------------------------------
def save(path, module, optimizer=None, extra=None):
    """Write module (and optimizer) state and `extra` to `path` (format: module docstring).
    Everything is encoded before the file is opened: a value that cannot be stored is a
    TypeError naming its key, and `path` is left as it was."""
    from . import __version__
    arrays, views = {}, {}
    header = {"format": FORMAT, "version": VERSION, "tecupy_version": __version__,
              "module_type": type(module).__name__,
              "module": _split("module", module.state_dict(), arrays, views),
              "optimizer": None, "extra": _check_extra({} if extra is None else extra)}
    if optimizer is not None:
        _check_optimizer(optimizer)
        header["optimizer"] = _split("optimizer", optimizer.state_dict(), arrays, views)
    header["views"] = views
    text = json.dumps(header, default=_json_default)
    arrays[HEADER] = np.frombuffer(text.encode("utf-8"), np.uint8)
    _write_atomic(os.fspath(path), arrays)


def _check_extra(extra):
    if not (isinstance(extra, dict) and all(isinstance(k, str) for k in extra)):
        raise TypeError("tecupy.save: extra must be a dict with str keys (JSON values), got "
                        f"{extra!r:.80}")
    return _json_check("extra", extra)


def _check_optimizer(optimizer):
    if not (callable(getattr(optimizer, "state_dict", None))
            and callable(getattr(optimizer, "load_state_dict", None))):
        raise TypeError("tecupy.save/load: optimizer must have state_dict() and "
                        f"load_state_dict(d); got {type(optimizer).__name__}")


def _split(section, sd, arrays, views):
    """Put the array values of state dict `sd` into `arrays` as "<section>/<key>" (ml_dtypes
    arrays as unsigned-int views, recorded in `views`); return the other values, checked
    to be JSON."""
    if not isinstance(sd, dict):
        raise TypeError(f"tecupy.save: {section}.state_dict() returned "
                        f"{type(sd).__name__}, expected a dict")
    values = {}
    for key, v in sd.items():
        if not isinstance(key, str):
            raise TypeError(f"tecupy.save: {section} state key {key!r} is not a str")
        if hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, np.generic):
            entry = f"{section}/{key}"
            arrays[entry], view = _encode_array(entry, np.asarray(to_numpy(v)))
            if view is not None:
                views[entry] = view
        else:
            values[key] = _json_check(f"{section} key {key!r}", v)
    return values


def _encode_array(entry, a):
    """(what .npy stores, the real dtype's name when it is stored as a view, else None)."""
    if a.dtype.kind in "biufc":
        return a, None
    if a.dtype.kind == "V" and hasattr(ml_dtypes, a.dtype.name):  # bfloat16, float8_*, ...
        return a.view(f"u{a.dtype.itemsize}"), a.dtype.name
    raise TypeError(f"tecupy.save: {entry!r} has dtype {a.dtype}; a checkpoint stores "
                    "numeric arrays only (bool, int, float, complex, ml_dtypes types)")


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray) and o.dtype.kind in "biuf":
        return {"__ndarray__": o.tolist(), "dtype": o.dtype.str}
    raise TypeError(f"{type(o).__name__} is not JSON-serialisable")


def _json_hook(d):
    if "__ndarray__" in d:
        return np.array(d["__ndarray__"], dtype=np.dtype(d["dtype"]))
    return d


def _json_check(what, v):
    """v itself, once it is known to go through JSON (a TypeError naming `what` if not)."""
    try:
        json.dumps(v, default=_json_default)
    except (TypeError, ValueError) as e:
        raise TypeError(f"tecupy.save: {what} cannot be stored as JSON ({e}); "
                        "store arrays in a state dict, plain values in extra") from None
    return v


def _write_atomic(path, arrays):
    """np.savez into a new temporary file in path's folder, fsync, rename over path. The
    file gets the mode a plain open() gives (0666 less the umask), or the old file's."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "xb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable (POSIX; not everywhere)
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


# ---- load -------------------------------------------------------------------------------
def load(path, module, optimizer=None):
    """Restore what save() wrote into `module` (on its own device) and `optimizer`; return
    the saved `extra` dict. Everything is checked first: a ValueError naming each key that
    does not fit, and nothing is loaded. A checkpoint with optimizer state loads into a
    module alone too (the optimizer state is then ignored)."""
    path = os.fspath(path)
    header, arrays = _read(path)
    sds = {s: _join(s, header, arrays, path) for s in SECTIONS if header[s] is not None}
    errors = _module_errors(module, sds["module"])
    if errors:
        raise ValueError(f"tecupy.load({path!r}): nothing was loaded; the checkpoint (saved "
                         f"from a {header.get('module_type')}) does not fit this "
                         f"{type(module).__name__}, {len(errors)} mismatch(es):\n  "
                         + "\n  ".join(errors))
    if optimizer is not None:
        _check_optimizer(optimizer)
        if "optimizer" not in sds:
            raise ValueError(f"tecupy.load({path!r}): nothing was loaded; an optimizer was "
                             "given but the checkpoint holds no optimizer state")
        try:  # first: its load_state_dict checks before it changes anything
            optimizer.load_state_dict(sds["optimizer"])
        except ValueError as e:
            raise ValueError(f"tecupy.load({path!r}): nothing was loaded; the optimizer "
                             f"state does not fit {type(optimizer).__name__}: {e}") from e
    module.load_state_dict(sds["module"])  # checked above: cannot fail on content
    return header["extra"]


def _module_errors(module, sd):
    """The mismatches loading `sd` into `module` would meet, without loading anything."""
    from .fp8_state import mismatch
    keys, errors = module._check_state_dict(sd)
    return errors + [mismatch(k, "an unexpected key", f"only the keys of "
                              f"{type(module).__name__}.state_dict()")
                     for k in sorted(set(sd) - set(keys))]


def _not_a_checkpoint(path, why):
    return ValueError(f"tecupy.load({path!r}): not a tecupy checkpoint ({why})")


def _read(path):
    """(header, {entry: array}) with the header's format and version checked."""
    arrays = _read_npz(path)
    if HEADER not in arrays:
        raise _not_a_checkpoint(path, f"no {HEADER!r} entry")
    try:
        header = json.loads(arrays.pop(HEADER).tobytes().decode("utf-8"),
                            object_hook=_json_hook)
    except ValueError as e:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise _not_a_checkpoint(path, f"its {HEADER!r} entry is not JSON: {e}") from None
    _check_header(path, header)
    sections = [s + "/" for s in SECTIONS if header[s] is not None]
    for entry in arrays:
        if not entry.startswith(tuple(sections)):
            raise _not_a_checkpoint(path, f"unexpected entry {entry!r}")
    return header, arrays


def _read_npz(path):
    """Every entry of the .npz at path, read into memory (no pickle)."""
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise _not_a_checkpoint(path, "a single .npy array, not an .npz")
        with z:
            return {name: z[name] for name in z.files}
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        if str(e).startswith("tecupy.load("):
            raise
        # numpy's ValueErrors: pickled data (any other file), a bad .npy header, ...
        raise _not_a_checkpoint(path, f"{type(e).__name__}: {e}") from None


def _check_header(path, header):
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else header
        raise _not_a_checkpoint(path, f"format {got!r}, expected {FORMAT!r}")
    if header.get("version") != VERSION:
        raise ValueError(f"tecupy.load({path!r}): checkpoint format version "
                         f"{header.get('version', 'missing')!r}; this tecupy reads version "
                         f"{VERSION}")
    kinds = {"module": (dict,), "optimizer": (dict, type(None)), "extra": (dict,),
             "views": (dict,)}
    for key, types in kinds.items():
        if not isinstance(header.get(key), types):
            raise _not_a_checkpoint(path, f"header {key!r} is "
                                    f"{type(header.get(key)).__name__}, expected "
                                    + " or ".join(t.__name__ for t in types))


def _join(section, header, arrays, path):
    """Section's state dict: its arrays (views undone) and its JSON values."""
    sd = dict(header[section])
    prefix = section + "/"
    for entry, a in arrays.items():
        if not entry.startswith(prefix):
            continue
        key = entry[len(prefix):]
        if key in sd:
            raise _not_a_checkpoint(path, f"key {key!r} is both an array and a JSON value")
        view = header["views"].get(entry)
        sd[key] = a if view is None else a.view(_view_dtype(path, entry, view, a))
    return sd


def _view_dtype(path, entry, name, a):
    dtype = np.dtype(getattr(ml_dtypes, name)) if isinstance(name, str) and \
        hasattr(ml_dtypes, name) else None
    if dtype is None or dtype.itemsize != a.dtype.itemsize:
        raise _not_a_checkpoint(path, f"entry {entry!r}: view dtype {name!r} does not fit "
                                f"its stored {a.dtype}")
    return dtype
