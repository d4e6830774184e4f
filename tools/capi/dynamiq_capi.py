"""ctypes binding of libdynamiq-capi.so (tools/capi/dynamiq_capi.h).

    lib = DynamiqCapi("/tmp/build/tools/capi/libdynamiq-capi.so")
    avg, stats = lib.allreduce("dynamiq:5", "ring", rows, seed=1, call=step)

`rows` is a sequence of n C-contiguous float32 numpy vectors of equal length (or a
[n, d] array, possibly a memory map); nothing is copied on the way in.
"""

import ctypes
import os
import pathlib

import numpy as np

ABI_VERSION = 2  # 2: dq_auto_choose
_ERR_LEN = 1024


class SimStats(ctypes.Structure):
    _fields_ = [("vnmse", ctypes.c_double),
                ("bits_per_coord", ctypes.c_double),
                ("wire_bits_per_coord", ctypes.c_double),
                ("seconds", ctypes.c_double),
                ("budget_honest", ctypes.c_int32)]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


class CapiError(RuntimeError):
    def __init__(self, code, name, message):
        super().__init__("dynamiq C API error %d (%s): %s" % (code, name, message))
        self.code = code


def default_library_path():
    """DQ_CAPI_LIB, else this checkout's build folder, else where the `dynamiq`
    package finds it (DYNAMIQ_PREFIX, or the installation both were installed into)."""
    env = os.environ.get("DQ_CAPI_LIB")
    if env:
        return pathlib.Path(env)
    here = pathlib.Path(__file__).resolve()
    # A checkout's own build folder only: never a shared folder such as /tmp, where another user's
    # library would be loaded into this process.
    if len(here.parents) > 2 and (here.parents[2] / "meson.build").exists():
        candidate = here.parents[2] / "build" / "tools" / "capi" / "libdynamiq-capi.so"
        if candidate.exists():
            return candidate
    try:
        import dynamiq
    except ImportError:
        dynamiq = None
    if dynamiq is not None:
        try:
            return dynamiq.library_path("capi")
        except FileNotFoundError:
            pass
    raise FileNotFoundError("libdynamiq-capi.so not found; set DQ_CAPI_LIB or DYNAMIQ_PREFIX, "
                            "or build tools/capi")


class DynamiqCapi:
    def __init__(self, path=None):
        self.path = pathlib.Path(path) if path else default_library_path()
        self.lib = ctypes.CDLL(str(self.path))
        lib = self.lib
        lib.dq_capi_abi_version.restype = ctypes.c_int
        lib.dq_status_name.argtypes = [ctypes.c_int]
        lib.dq_status_name.restype = ctypes.c_char_p
        lib.dq_set_max_threads.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        lib.dq_set_max_threads.restype = ctypes.c_int
        lib.dq_allreduce_sim.argtypes = [
            ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint64,
            ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(SimStats),
            ctypes.c_char_p, ctypes.c_size_t]
        lib.dq_allreduce_sim.restype = ctypes.c_int
        lib.dq_auto_choose.argtypes = [
            ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_double),
            ctypes.c_char_p, ctypes.c_size_t]
        lib.dq_auto_choose.restype = ctypes.c_int
        version = lib.dq_capi_abi_version()
        if version != ABI_VERSION:
            raise CapiError(7, "unsupported", "library ABI %d, binding expects %d" %
                            (version, ABI_VERSION))

    def _check(self, code, err):
        if code != 0:
            raise CapiError(code, self.lib.dq_status_name(code).decode(),
                            err.value.decode(errors="replace"))

    def set_max_threads(self, threads):
        err = ctypes.create_string_buffer(_ERR_LEN)
        self._check(self.lib.dq_set_max_threads(int(threads), err, _ERR_LEN), err)

    @staticmethod
    def _row_pointers(rows):
        """(pointers, d) of [n, d] float32 rows, each contiguous."""
        n = len(rows)
        d = None
        pointers = (ctypes.c_void_p * n)()
        for i, row in enumerate(rows):
            if row.dtype != np.float32 or row.ndim != 1 or not row.flags["C_CONTIGUOUS"]:
                raise ValueError("row %d must be a contiguous 1-D float32 vector" % i)
            if d is None:
                d = row.shape[0]
            elif row.shape[0] != d:
                raise ValueError("row %d has %d values, row 0 has %d" % (i, row.shape[0], d))
            pointers[i] = row.ctypes.data
        return pointers, d

    def auto_choose(self, target, topo, rows):
        """(codec spec, predicted vNMSE) that DYNAMIQ_BITS=auto chooses for the next call of a
        bucket whose previous call all-reduced rows ([n, d] float32) over topo."""
        pointers, d = self._row_pointers(rows)
        spec = ctypes.create_string_buffer(64)
        predicted = ctypes.c_double(0.0)
        err = ctypes.create_string_buffer(_ERR_LEN)
        code = self.lib.dq_auto_choose(target.encode(), topo.encode(), len(rows), pointers, d,
                                       spec, 64, ctypes.byref(predicted), err, _ERR_LEN)
        self._check(code, err)
        return spec.value.decode(), predicted.value

    def allreduce(self, codec, topo, rows, seed=1, call=0, average=True, out=None,
                  want_result=True):
        """Returns (result or None, stats dict). rows: [n, d] float32, rows contiguous."""
        n = len(rows)
        pointers, d = self._row_pointers(rows)
        if want_result and out is None:
            out = np.empty(d, dtype=np.float32)
        if out is not None and (out.dtype != np.float32 or out.shape != (d,) or
                                not out.flags["C_CONTIGUOUS"]):
            raise ValueError("out must be a contiguous float32 vector of %d values" % d)
        stats = SimStats()
        err = ctypes.create_string_buffer(_ERR_LEN)
        code = self.lib.dq_allreduce_sim(
            codec.encode(), topo.encode(), n, pointers, d, seed, call, 1 if average else 0,
            out.ctypes.data if out is not None else None, ctypes.byref(stats), err, _ERR_LEN)
        self._check(code, err)
        return out, stats.as_dict()
