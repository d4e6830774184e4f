#!/usr/bin/env python3
"""Unit tests of the Python package `dynamiq` (python/dynamiq) that need neither torch, a GPU,
nor the shim in the process: finding the libraries, turning process-group-like objects into
communicator handles, the errors of register() without the shim, reading a metrics file.

usage: package_test.py  (environment: DQ_BUILD_ROOT = a Meson build directory of this tree)
"""

import contextlib
import ctypes
import importlib.abc
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import types
import unittest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))


class BlockTorch(importlib.abc.MetaPathFinder):
    """Makes `import torch` fail as it does where torch is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named %r (blocked by the test)" % name)
        return None


sys.meta_path.insert(0, BlockTorch())
import dynamiq  # noqa: E402  (after the blocker: the package must import without torch)


@contextlib.contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Backend:
    def __init__(self, ptr):
        self.ptr = ptr

    def _comm_ptr(self):
        return self.ptr


class TorchLikeGroup:
    """A ProcessGroup's shape: the handle is only reachable through _get_backend(device)."""

    def _get_backend(self, device):
        return Backend(0x1234)


@contextlib.contextmanager
def fake_torch(current=0):
    """A stand-in torch in sys.modules for the paths of comm_handle() that import it: devices
    as strings, a current CUDA device that torch.cuda.device() switches, and
    torch.distributed.GroupMember.NON_GROUP_MEMBER (-100, as torch's)."""
    torch = types.ModuleType("torch")
    cuda = types.SimpleNamespace(now=current)
    cuda.current_device = lambda: cuda.now

    @contextlib.contextmanager
    def device(d):
        before, cuda.now = cuda.now, int(str(d).split(":")[1])
        try:
            yield
        finally:
            cuda.now = before

    cuda.device = device
    torch.cuda = cuda
    torch.device = str
    dist = types.ModuleType("torch.distributed")
    dist.GroupMember = types.SimpleNamespace(NON_GROUP_MEMBER=-100)
    torch.distributed = dist
    sys.modules["torch"], sys.modules["torch.distributed"] = torch, dist
    try:
        yield torch
    finally:
        del sys.modules["torch"], sys.modules["torch.distributed"]


class PerDeviceBackend:
    """NCCL's backend as torch's: _comm_ptr() answers for the current CUDA device only."""

    def __init__(self, torch, ptrs):
        self.torch, self.ptrs = torch, ptrs

    def _comm_ptr(self):
        return self.ptrs.get(self.torch.cuda.current_device(), 0)


class ImportTest(unittest.TestCase):
    def test_no_torch(self):
        self.assertNotIn("torch", sys.modules)
        with self.assertRaises(ImportError):
            import torch  # noqa: F401

    def test_versions_agree(self):
        meson = (REPO / "meson.build").read_text()
        pyproject = (REPO / "python" / "pyproject.toml").read_text()
        want = re.search(r"version: '([^']+)'", meson).group(1)
        self.assertEqual(dynamiq.__version__, want)
        self.assertEqual(re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1), want)


class HandleTest(unittest.TestCase):
    def test_accepted_shapes(self):
        self.assertEqual(dynamiq.comm_handle(0x1234), 0x1234)
        self.assertEqual(dynamiq.comm_handle(ctypes.c_void_p(0x1234)), 0x1234)
        self.assertEqual(dynamiq.comm_handle(Backend(0x1234)), 0x1234)

    def test_refused_shapes(self):
        with self.assertRaisesRegex(RuntimeError, "does not exist yet"):
            dynamiq.comm_handle(Backend(0))
        with self.assertRaises(TypeError):
            dynamiq.comm_handle(True)
        with self.assertRaisesRegex(TypeError, "cannot get an NCCL communicator"):
            dynamiq.comm_handle(object())

    def test_torch_objects_need_torch(self):
        # A ProcessGroup or the default group (None) can only be read with torch; without it
        # the ImportError says so instead of a crash elsewhere.
        with self.assertRaises(ImportError):
            dynamiq.comm_handle(TorchLikeGroup())
        with self.assertRaises(ImportError):
            dynamiq.comm_handle(None)

    def test_a_rank_outside_the_group(self):
        # new_group() returns torch's NON_GROUP_MEMBER on the ranks it leaves out: register()
        # is then nothing to do (called on every rank, as its documentation asks), and
        # comm_handle() says why there is no communicator, not "unknown to dynamiq".
        with fake_torch():
            self.assertIsNone(dynamiq.register(-100))
            with self.assertRaisesRegex(ValueError, "not a member"):
                dynamiq.comm_handle(-100)
        with self.assertRaisesRegex(ValueError, "an address"):
            dynamiq.comm_handle(-100)

    def test_wrapped_backend(self):
        # TORCH_DISTRIBUTED_DEBUG=DETAIL: the group's CUDA backend wraps NCCL's (wrapped_pg).
        class Wrapper:
            wrapped_pg = Backend(0x1234)

        class Group:
            def _get_backend(self, device):
                return Wrapper()

        with fake_torch():
            self.assertEqual(dynamiq.comm_handle(Group()), 0x1234)

    def test_bound_device_names_the_communicator(self):
        # torch looks the communicator up on the current CUDA device; a group bound to device 3
        # (init_process_group(device_id=...)) has its communicator there while the current
        # device is still 0.
        with fake_torch(current=0) as torch:
            backend = PerDeviceBackend(torch, {3: 0x3000})

            class Bound:
                bound_device_id = "cuda:3"

                def _get_backend(self, device):
                    return backend

            class Unbound:
                def _get_backend(self, device):
                    return backend

            self.assertEqual(dynamiq.comm_handle(Bound()), 0x3000)
            self.assertEqual(torch.cuda.current_device(), 0)  # restored
            with self.assertRaisesRegex(RuntimeError, "does not exist yet on cuda:0"):
                dynamiq.comm_handle(Unbound())

    def test_register_without_shim(self):
        with self.assertRaisesRegex(RuntimeError, "LD_PRELOAD"):
            dynamiq.register(Backend(0x1234))
        with self.assertRaisesRegex(RuntimeError, "LD_PRELOAD"):
            dynamiq.counters(Backend(0x1234))


class LocateTest(unittest.TestCase):
    def test_build_directory(self):
        build = os.environ.get("DQ_BUILD_ROOT")
        if not build:
            self.skipTest("DQ_BUILD_ROOT not set")
        with env(DYNAMIQ_PREFIX=build):
            self.assertEqual(dynamiq.library_path(),
                             pathlib.Path(build).resolve() / "shim" / "libdynamiq.so")
            for kind in ("plugin", "capi", "cpu-nccl"):
                self.assertTrue(dynamiq.library_path(kind).is_file(), kind)

    def test_prefix_and_errors(self):
        with tempfile.TemporaryDirectory() as tmp:
            lib = pathlib.Path(tmp) / "lib"
            (lib / "dynamiq" / "cpu-nccl").mkdir(parents=True)
            for name in ("libdynamiq.so", "dynamiq/cpu-nccl/libnccl.so.2"):
                (lib / name).write_bytes(b"")
            with env(DYNAMIQ_PREFIX=tmp):
                self.assertEqual(dynamiq.library_path(), lib / "libdynamiq.so")
                self.assertEqual(dynamiq.library_path("cpu-nccl"),
                                 lib / "dynamiq" / "cpu-nccl" / "libnccl.so.2")
        with self.assertRaises(ValueError):
            dynamiq.library_path("nccl")

    def test_not_found(self):
        # A copy of the package outside any checkout or installation, DYNAMIQ_PREFIX empty of
        # libraries: the error names every path tried.
        from dynamiq import _locate
        if any((d / "libnccl-net-dynamiq.so").exists()
               for prefix in _locate.SYSTEM_PREFIXES for d in _locate._libdirs(prefix)):
            self.skipTest("dynamiq is installed under %s" % (_locate.SYSTEM_PREFIXES,))
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(REPO / "python" / "dynamiq", pathlib.Path(tmp) / "py" / "dynamiq",
                            ignore=shutil.ignore_patterns("*.in", "__pycache__"))
            out = subprocess.run(
                [sys.executable, "-m", "dynamiq", "library-path", "plugin"], capture_output=True,
                text=True, env=dict(os.environ, PYTHONPATH=tmp + "/py", DYNAMIQ_PREFIX=tmp),
                cwd=tmp, timeout=60)
            self.assertEqual(out.returncode, 1)
            self.assertIn("libnccl-net-dynamiq.so not found; tried: %s/plugin/abi/" % tmp,
                          out.stderr)

    def test_installed_layout_is_relocatable(self):
        # What meson install writes (python/meson.build): the package with _install.py, below
        # <prefix>/<python dir>; found from wherever the tree was copied to.
        with tempfile.TemporaryDirectory() as tmp:
            prefix = pathlib.Path(tmp) / "staged" / "opt" / "dq"
            pydir = "lib/python3/site-packages"
            pkg = prefix / pydir / "dynamiq"
            shutil.copytree(REPO / "python" / "dynamiq", pkg,
                            ignore=shutil.ignore_patterns("*.in", "__pycache__"))
            (pkg / "_install.py").write_text(
                'VERSION = "%s"\nPREFIX = "/opt/dq"\nLIBDIR = "lib/x86_64-linux-gnu"\n'
                'BINDIR = "bin"\nDATADIR = "share"\nPYTHONDIR = "%s/"\n'
                % (dynamiq.__version__, pydir))
            lib = prefix / "lib" / "x86_64-linux-gnu"
            lib.mkdir(parents=True)
            (lib / "libdynamiq.so").write_bytes(b"")
            out = subprocess.run(
                [sys.executable, "-m", "dynamiq", "library-path"], capture_output=True,
                text=True, env=dict(os.environ, PYTHONPATH=str(prefix / pydir),
                                    DYNAMIQ_PREFIX=""), cwd=tmp, timeout=60)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(out.stdout.strip(), str(lib / "libdynamiq.so"))

    def test_cli(self):
        out = subprocess.run([sys.executable, "-m", "dynamiq", "version"], capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "python")),
                             timeout=60)
        self.assertEqual((out.returncode, out.stdout.strip()), (0, dynamiq.__version__))
        out = subprocess.run([sys.executable, "-m", "dynamiq", "bogus"], capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "python")),
                             timeout=60)
        self.assertEqual(out.returncode, 2)
        self.assertIn("library-path", out.stderr)


class WheelLayoutTest(unittest.TestCase):
    """The layout a wheel installs (pyproject.toml, -Dwheel=true): lib/, bin/ and share/ inside
    the package, the shim only under its versioned name (a wheel holds no symbolic links)."""

    def make_wheel_tree(self, tmp):
        site = pathlib.Path(tmp) / "site"
        pkg = site / "dynamiq"
        shutil.copytree(REPO / "python" / "dynamiq", pkg,
                        ignore=shutil.ignore_patterns("*.in", "__pycache__"))
        (pkg / "_install.py").write_text(
            'VERSION = "%s"\nPREFIX = "/usr/local"\nLIBDIR = "lib"\nBINDIR = "bin"\n'
            'DATADIR = "share"\nPKGDATADIR = "share"\nPYTHONDIR = "lib/python3/site-packages"\n'
            "WHEEL = True\n" % dynamiq.__version__)
        (pkg / "lib" / "dynamiq" / "cpu-nccl").mkdir(parents=True)
        (pkg / "bin").mkdir()
        for name in ("libdynamiq.so.0.1.0", "libnccl-net-dynamiq.so",
                     "dynamiq/cpu-nccl/libnccl.so.2"):
            (pkg / "lib" / name).write_bytes(b"")
        return site, pkg

    def run_module(self, site, tmp, *args, **extra_env):
        environ = {k: v for k, v in os.environ.items()
                   if k not in ("DYNAMIQ_PREFIX", "LD_PRELOAD", "DYNAMIQ_ENABLE")}
        environ.update(PYTHONPATH=str(site), **extra_env)
        return subprocess.run([sys.executable, "-m", "dynamiq"] + list(args), capture_output=True,
                              text=True, env=environ, cwd=tmp, timeout=60)

    def test_finds_the_package_libraries(self):
        with tempfile.TemporaryDirectory() as tmp:
            site, pkg = self.make_wheel_tree(tmp)
            out = self.run_module(site, tmp, "library-path")
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(out.stdout.strip(), str(pkg / "lib" / "libdynamiq.so.0.1.0"))
            out = self.run_module(site, tmp, "library-path", "cpu-nccl")
            self.assertEqual(out.stdout.strip(),
                             str(pkg / "lib" / "dynamiq" / "cpu-nccl" / "libnccl.so.2"))
            out = self.run_module(site, tmp, "data-path")
            self.assertEqual(out.stdout.strip(), str(pkg / "share"))

    def test_run_sets_the_job_environment(self):
        show = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
                "('LD_PRELOAD', 'LD_LIBRARY_PATH', 'PATH', 'DYNAMIQ_ENABLE')}))")
        with tempfile.TemporaryDirectory() as tmp:
            site, pkg = self.make_wheel_tree(tmp)
            out = self.run_module(site, tmp, "run", "--", sys.executable, "-c", show,
                                  LD_PRELOAD="/opt/other.so", LD_LIBRARY_PATH="/opt/lib")
            self.assertEqual(out.returncode, 0, out.stderr)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            shim = str(pkg / "lib" / "libdynamiq.so.0.1.0")
            self.assertEqual(got["LD_PRELOAD"], shim + " /opt/other.so")
            self.assertEqual(got["LD_LIBRARY_PATH"], str(pkg / "lib") + ":/opt/lib")
            self.assertEqual(got["PATH"].split(":")[0], str(pkg / "bin"))
            self.assertEqual(got["DYNAMIQ_ENABLE"], "1")
            # A value the caller set is kept; so is an already-preloaded shim, once.
            out = self.run_module(site, tmp, "run", sys.executable, "-c", show,
                                  DYNAMIQ_ENABLE="0", LD_PRELOAD=shim)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            self.assertEqual((got["DYNAMIQ_ENABLE"], got["LD_PRELOAD"]), ("0", shim))
            out = self.run_module(site, tmp, "run")
            self.assertEqual(out.returncode, 2)
            out = self.run_module(site, tmp, "run", "--", "/nonexistent/program")
            self.assertEqual(out.returncode, 127)
            self.assertIn("cannot run /nonexistent/program", out.stderr)

    def test_version_flag(self):
        out = subprocess.run([sys.executable, "-m", "dynamiq", "--version"], capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "python")),
                             timeout=60)
        self.assertEqual((out.returncode, out.stdout.strip()), (0, dynamiq.__version__))


class MetricsFileTest(unittest.TestCase):
    def test_path_substitution(self):
        with env(DYNAMIQ_METRICS_FILE="/m/%r-%p.json", RANK="3"):
            self.assertEqual(dynamiq.metrics_path(), "/m/3-%d.json" % os.getpid())
            self.assertEqual(dynamiq.metrics_path(rank=5), "/m/5-%d.json" % os.getpid())
        # Under mpirun or srun without RANK: the launcher's rank, as the shim names the file.
        with env(DYNAMIQ_METRICS_FILE="/m/%r.json", RANK=None, OMPI_COMM_WORLD_RANK="4",
                 PMI_RANK=None, SLURM_PROCID=None):
            self.assertEqual(dynamiq.metrics_path(), "/m/4.json")
        with env(DYNAMIQ_METRICS_FILE="/m/%r.json", RANK=None, OMPI_COMM_WORLD_RANK=None,
                 PMI_RANK=None, SLURM_PROCID="6"):
            self.assertEqual(dynamiq.metrics_path(), "/m/6.json")
        with env(DYNAMIQ_METRICS_FILE=None):
            self.assertIsNone(dynamiq.metrics_path())

    def test_reads_json(self):
        with tempfile.TemporaryDirectory() as tmp:
            data = {"pid": os.getpid(), "communicators": [{"index": 0, "calls": {"rerouted": 2}}]}
            (pathlib.Path(tmp) / "m.1.json").write_text(json.dumps(data))
            with env(DYNAMIQ_METRICS_FILE=tmp + "/m.%r.json", RANK="1"):
                self.assertEqual(dynamiq.counters(), data)
            with env(DYNAMIQ_METRICS_FILE=tmp + "/m.prom"):
                with self.assertRaisesRegex(ValueError, "Prometheus"):
                    dynamiq.counters()
        with env(DYNAMIQ_METRICS_FILE=None):
            with self.assertRaisesRegex(RuntimeError, "DYNAMIQ_METRICS_FILE"):
                dynamiq.counters()


if __name__ == "__main__":
    unittest.main(verbosity=2)
