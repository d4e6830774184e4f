"""The native tools of dynamiq (dynamiq-run, -sim, -perf, -demo, -predict) and the environment
that preloads dynamiq into a job, for `python -m dynamiq` and a wheel's console scripts.

A wheel (`pip install .`) keeps the executables in the package's bin/ folder next to lib/, where
the launcher finds the CPU NCCL and the net plugin from its own location; the console scripts
pip writes for them (pyproject.toml [project.scripts]) replace themselves with the executable.
"""

import os
import pathlib
import sys

from . import _locate

TOOLS = ("dynamiq-run", "dynamiq-sim", "dynamiq-perf", "dynamiq-demo", "dynamiq-predict")


def bin_dir():
    """The folder holding this installation's executables, or None (source tree, pip ./python).

    A wheel or a `meson install` records it in _install.py; a checkout's build/tools otherwise."""
    info = _locate._install_info()
    prefix = _locate.installed_prefix()
    if info is not None and prefix is not None:
        path = pathlib.Path(info.BINDIR)
        return path if path.is_absolute() else prefix / path
    checkout_tools = _locate.PACKAGE_DIR.parent.parent / "build" / "tools"
    return checkout_tools if checkout_tools.is_dir() else None


def data_dir():
    """The folder of the installed data (gradients/sample/step00079.npy: the demo's input)."""
    info = _locate._install_info()
    prefix = _locate.installed_prefix()
    if info is not None and prefix is not None and hasattr(info, "PKGDATADIR"):
        path = pathlib.Path(info.PKGDATADIR)
        return path if path.is_absolute() else prefix / path
    return _locate.PACKAGE_DIR.parent.parent / "tools"  # a checkout: tools/gradients/sample


def tool_path(name):
    """Path of the executable `name` (one of TOOLS); FileNotFoundError when it is not there."""
    folder = bin_dir()
    if folder is not None and (folder / name).is_file():
        return folder / name
    raise FileNotFoundError("%s not found in %s (this installation has no native tools: install "
                            "the wheel, `pip install .` at the repository root)" % (name, folder))


def job_environment(environ=None):
    """The environment of a job with dynamiq preloaded: LD_PRELOAD gains libdynamiq.so,
    LD_LIBRARY_PATH the net plugin's folder (NCCL dlopens libnccl-net-dynamiq.so by name when
    NCCL_NET_PLUGIN=dynamiq), PATH the tools' folder, and DYNAMIQ_ENABLE is 1 unless set."""
    env = dict(os.environ if environ is None else environ)

    def prepend(key, value, sep):
        parts = [p for p in env.get(key, "").split(sep) if p]
        if value not in parts:
            parts.insert(0, value)
        env[key] = sep.join(parts)

    # LD_PRELOAD accepts spaces or colons between entries; ours goes first.
    preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    shim = str(_locate.find("shim"))
    env["LD_PRELOAD"] = " ".join([shim] + [p for p in preload if p != shim])
    prepend("LD_LIBRARY_PATH", str(_locate.find("plugin").parent), ":")
    folder = bin_dir()
    if folder is not None:
        prepend("PATH", str(folder), ":")
    env.setdefault("DYNAMIQ_ENABLE", "1")
    return env


def exec_tool(name, argv):
    os.execv(str(tool_path(name)), [name] + list(argv))


def _console(name):
    def main():
        try:
            exec_tool(name, sys.argv[1:])
        except FileNotFoundError as e:
            print("dynamiq: %s" % e, file=sys.stderr)
            return 127
    main.__name__ = name.replace("-", "_")
    return main


dynamiq_run = _console("dynamiq-run")
dynamiq_sim = _console("dynamiq-sim")
dynamiq_perf = _console("dynamiq-perf")
dynamiq_demo = _console("dynamiq-demo")
dynamiq_predict = _console("dynamiq-predict")
