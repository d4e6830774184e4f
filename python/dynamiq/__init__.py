"""Python entry points of dynamiq, the compressed gradient all-reduce for NCCL jobs.

    LD_PRELOAD=$(python3 -m dynamiq library-path) DYNAMIQ_ENABLE=1 torchrun ... train.py

    import dynamiq
    dynamiq.register(process_group)   # opt a torch.distributed NCCL group in (C API)
    dynamiq.counters(process_group)   # {'rerouted': 3, 'passed': 41, 'bytes_in': ..., ...}
    dynamiq.counters()                # the DYNAMIQ_METRICS_FILE of this process (JSON)

Pure Python over ctypes. Importing it never imports torch; only register() and counters()
given a torch ProcessGroup (or None for the default group) do.
"""

import ctypes
import json
import os
import sys

from . import _locate

__version__ = "0.1.0"
__all__ = ["library_path", "register", "counters", "comm_handle", "metrics_path",
           "DynamiqError"]

# ncclResult_t values the C API returns (shim/dynamiq.h).
_NCCL_INVALID_ARGUMENT = 4
_NCCL_INVALID_USAGE = 5


class DynamiqError(RuntimeError):
    """A C API call failed; `code` is the ncclResult_t it returned."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def library_path(kind="shim"):
    """Path of a dynamiq library (a pathlib.Path that exists).

    kind: "shim" (libdynamiq.so, for LD_PRELOAD), "plugin" (libnccl-net-dynamiq.so, the NCCL
    net plugin; its folder goes on LD_LIBRARY_PATH with NCCL_NET_PLUGIN=dynamiq), "capi"
    (libdynamiq-capi.so, the simulator's C API) or "cpu-nccl" (the CPU NCCL's libnccl.so.2).
    Looked up in DYNAMIQ_PREFIX (an install prefix or a build directory), then in the
    installation this package belongs to, then in the checkout's build/ folder, then under
    /usr/local and /usr; raises FileNotFoundError naming every path tried.
    """
    if kind not in _locate.FILES:
        raise ValueError("kind must be one of %s, not %r" % (", ".join(_locate.FILES), kind))
    return _locate.find(kind)


def _shim():
    """The C API of the libdynamiq.so loaded in this process (it must be preloaded: loading it
    later would not interpose NCCL)."""
    lib = ctypes.CDLL(None)
    try:
        lib.dynamiqCommRegister
    except AttributeError:
        raise RuntimeError(
            "libdynamiq.so is not loaded in this process: start the process with "
            "LD_PRELOAD=<path> (dynamiq.library_path() or `python3 -m dynamiq library-path` "
            "prints it)") from None
    lib.dynamiqCommRegister.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.dynamiqCommRegister.restype = ctypes.c_int
    for name in ("dynamiqCommCounters", "dynamiqCommBytes"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong),
                       ctypes.POINTER(ctypes.c_ulonglong)]
        fn.restype = ctypes.c_int
    lib.dynamiqMetricsFlush.argtypes = []
    lib.dynamiqMetricsFlush.restype = ctypes.c_int
    path_fn = getattr(lib, "dynamiqMetricsPath", None)  # absent from older libdynamiq.so
    if path_fn is not None:
        path_fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        path_fn.restype = ctypes.c_int
    return lib


def _shim_metrics_path():
    """The metrics file the preloaded shim writes, as it expands DYNAMIQ_METRICS_FILE (%j, %h,
    %r, %p, a directory's file name); None without the shim or without a configured file."""
    try:
        lib = _shim()
    except RuntimeError:
        return None
    fn = getattr(lib, "dynamiqMetricsPath", None)
    if fn is None:
        return None
    buf = ctypes.create_string_buffer(4096)
    if fn(buf, len(buf)) != 0:
        return None
    return os.fsdecode(buf.value)


def _default_group():
    import torch.distributed as dist  # only when the caller asks for the default group

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized (call init_process_group first)")
    return dist.group.WORLD


def _outside_group(group):
    """Whether `group` is what torch.distributed.new_group() returns on a rank outside the new
    group (GroupMember.NON_GROUP_MEMBER, an int sentinel), asked only where torch is loaded."""
    dist = sys.modules.get("torch.distributed")
    sentinel = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    if sentinel is None or isinstance(group, bool):
        return False
    return group is sentinel or (isinstance(group, int) and isinstance(sentinel, int)
                                 and group == sentinel)


def comm_handle(group):
    """The raw ncclComm_t of `group` as an int.

    group: a torch.distributed ProcessGroup using NCCL (its NCCL backend's `_comm_ptr()`, for
    the group's bound CUDA device where it has one, else the current one), a backend object with
    `_comm_ptr()`, an int or ctypes.c_void_p holding the handle, or None for torch.distributed's
    default group.
    """
    if group is None:
        group = _default_group()
    if _outside_group(group):
        raise ValueError("this rank is not a member of the group (torch.distributed's "
                         "NON_GROUP_MEMBER): it has no communicator")
    if isinstance(group, bool):
        raise TypeError("a communicator handle cannot be a bool")
    device = None  # where torch looks the communicator up, for the messages
    if isinstance(group, int):
        ptr = group
    elif isinstance(group, ctypes.c_void_p):
        ptr = group.value or 0
    else:
        getter = getattr(group, "_comm_ptr", None)
        bound = None
        if getter is None and hasattr(group, "_get_backend"):
            import torch  # a torch ProcessGroup: torch is necessarily importable here

            backend = group._get_backend(torch.device("cuda"))
            # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the NCCL backend (wrapped_pg holds it).
            for _ in range(4):
                if getattr(backend, "_comm_ptr", None) is not None:
                    break
                backend = getattr(backend, "wrapped_pg", backend)
            getter = getattr(backend, "_comm_ptr", None)
            if getter is None:
                raise TypeError(
                    "the CUDA backend of this process group (%s) exposes no _comm_ptr(): not an "
                    "NCCL group, or a PyTorch too old to expose its communicator"
                    % type(backend).__name__)
            # _comm_ptr() looks the communicator up on the current CUDA device; a group bound to
            # its device (init_process_group(device_id=...)) names the right one.
            bound = getattr(group, "bound_device_id", None)
            device = bound if bound is not None else "cuda:%d" % torch.cuda.current_device()
        if getter is None:
            raise TypeError("cannot get an NCCL communicator from %r: expected a "
                            "torch.distributed ProcessGroup, an object with _comm_ptr(), or an "
                            "int handle" % (group,))
        if bound is not None and callable(getter):
            import torch

            with torch.cuda.device(bound):
                ptr = int(getter())
        else:
            ptr = int(getter() if callable(getter) else getter)
    if ptr < 0:
        raise ValueError("a communicator handle is an address, not %d" % ptr)
    if ptr == 0:
        raise RuntimeError(
            "the NCCL communicator does not exist yet on %s (PyTorch creates it at the group's "
            "first collective on that device, and looks it up on the current CUDA device: call "
            "torch.cuda.set_device(local_rank) first); create it with a collective that is not "
            "an all-reduce, e.g. a broadcast, then register before the first all-reduce"
            % (device or "this device"))
    return ptr


def register(group=None, enable=True):
    """Opts `group`'s NCCL communicator in (enable=True) or out of compression, overriding
    DYNAMIQ_COMMS, through the C API dynamiqCommRegister(comm, enable).

    Call it on every rank of the group, after the communicator exists and before its first
    all-reduce. group: see comm_handle(). Returns the handle; None on a rank outside the group
    (what torch.distributed.new_group() returned there), where there is nothing to register.
    Raises RuntimeError when libdynamiq.so is not preloaded, DynamiqError (code 4) for a
    communicator the shim did not see created, DynamiqError (code 5) after the communicator's
    first all-reduce.
    """
    if group is not None and _outside_group(group):
        return None
    ptr = comm_handle(group)
    rc = _shim().dynamiqCommRegister(ctypes.c_void_p(ptr), 1 if enable else 0)
    if rc == _NCCL_INVALID_ARGUMENT:
        raise DynamiqError(rc, "dynamiqCommRegister: communicator 0x%x unknown to dynamiq (not "
                           "created by this process after libdynamiq.so was loaded)" % ptr)
    if rc == _NCCL_INVALID_USAGE:
        raise DynamiqError(rc, "dynamiqCommRegister: communicator 0x%x already ran its first "
                           "all-reduce; register before it" % ptr)
    if rc != 0:
        raise DynamiqError(rc, "dynamiqCommRegister returned %d" % rc)
    return ptr


def _launcher_rank():
    """The launcher's rank of this process, as the shim reads it: RANK, OMPI_COMM_WORLD_RANK,
    PMI_RANK or SLURM_PROCID, the first that is a decimal (common/launcher_env.h's order); None
    without one."""
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        value = os.environ.get(key, "")
        if value.isdigit() and value.isascii() and int(value) < 2 ** 30:
            return int(value)
    return None


def metrics_path(pattern=None, rank=None):
    """The metrics file of a process: `pattern` (default DYNAMIQ_METRICS_FILE) with %p replaced by
    this process's pid and %r by `rank` (default: the launcher's rank, RANK, OMPI_COMM_WORLD_RANK,
    PMI_RANK or SLURM_PROCID, else 0). The shim writes %r as that launcher's rank too (unless a
    communicator is larger than the launcher's job: then the rank in the largest communicator),
    so for another process pass its rank."""
    pattern = pattern if pattern is not None else os.environ.get("DYNAMIQ_METRICS_FILE", "")
    if not pattern:
        return None
    if rank is None:
        launcher = _launcher_rank()
        rank = launcher if launcher is not None else 0
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "%" and i + 1 < len(pattern) and pattern[i + 1] in "rp":
            out.append(str(rank) if pattern[i + 1] == "r" else str(os.getpid()))
            i += 2
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


def counters(group=None, metrics_file=None, rank=None):
    """The engine's counters as a dict.

    With `group` (anything comm_handle() accepts except None): that communicator's counters
    from the preloaded shim's C API, {'rerouted', 'passed', 'bytes_in', 'wire_bytes'}: calls
    compressed and passed through to NCCL, caller bytes of the compressed calls and the bytes
    this rank sent for them.

    Without `group`: the metrics file of this process, parsed as JSON and returned as the shim
    wrote it: `metrics_file` if given, else the file the preloaded shim writes (its own expansion
    of DYNAMIQ_METRICS_FILE, rewritten first through dynamiqMetricsFlush()), else
    metrics_path(). Prometheus files (.prom, a directory pattern's) are refused with ValueError:
    use a JSON name.
    """
    if group is not None:
        lib = _shim()
        ptr = ctypes.c_void_p(comm_handle(group))
        a, b = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        rc = lib.dynamiqCommCounters(ptr, ctypes.byref(a), ctypes.byref(b))
        if rc != 0:
            raise DynamiqError(rc, "dynamiqCommCounters: communicator 0x%x unknown to dynamiq"
                               % ptr.value)
        out = {"rerouted": a.value, "passed": b.value}
        rc = lib.dynamiqCommBytes(ptr, ctypes.byref(a), ctypes.byref(b))
        if rc != 0:
            raise DynamiqError(rc, "dynamiqCommBytes returned %d" % rc)
        out.update(bytes_in=a.value, wire_bytes=b.value)
        return out
    path = None
    if metrics_file is None and rank is None:
        path = _shim_metrics_path()
    if path is None:
        path = metrics_path(metrics_file, rank)
    if path is None:
        raise RuntimeError("no metrics file: pass a communicator, or set DYNAMIQ_METRICS_FILE "
                           "(a .json name) in the job's environment")
    if path.endswith("/") or path.endswith(".prom"):
        raise ValueError("%s is Prometheus text; counters() reads the JSON form (a metrics file "
                         "name not ending in .prom)" % path)
    try:
        lib = _shim()
    except RuntimeError:
        lib = None  # no shim in this process: read what a shim process wrote
    if lib is not None:
        rc = lib.dynamiqMetricsFlush()
        if rc != 0:
            raise DynamiqError(rc, "dynamiqMetricsFlush returned %d: %s could not be written now "
                                   "(the shim's warning says why)" % (rc, path))
    with open(path, encoding="utf-8") as f:
        return json.load(f)
