"""Finds the files of a dynamiq build or installation.

Order, for every file: the DYNAMIQ_PREFIX environment variable (an install prefix or a Meson
build directory), then the installed tree this package belongs to (when `meson install` put it
there, it left _install.py next to this file), then the build directory `build/` of the checkout
this package lives in (python/dynamiq in the source tree), then /usr/local and /usr.
"""

import os
import pathlib
import sysconfig

# Each file: (folder in a Meson build directory, folder below the libdir of an installation).
FILES = {
    "shim": ("libdynamiq.so", "shim", "."),
    "plugin": ("libnccl-net-dynamiq.so", "plugin/abi", "."),
    "capi": ("libdynamiq-capi.so", "tools/capi", "."),
    "cpu-nccl": ("libnccl.so.2", "tools/cpu-nccl", "dynamiq/cpu-nccl"),
}

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
SYSTEM_PREFIXES = ("/usr/local", "/usr")  # Meson's default prefix, then the distribution's


def _install_info():
    try:
        from . import _install  # written by meson install (python/meson.build)
    except ImportError:
        return None
    return _install


def installed_prefix():
    """The prefix of the installation this package is part of, or None (source tree, pip).

    Computed from where the package is now, so a staged (DESTDIR) or moved tree works. A wheel
    keeps lib/, bin/ and share/ inside the package: its prefix is the package folder."""
    info = _install_info()
    if info is None:
        return None
    if getattr(info, "WHEEL", False):
        return PACKAGE_DIR
    pydir = pathlib.PurePosixPath(info.PYTHONDIR)
    if pydir.is_absolute():
        return pathlib.Path(info.PREFIX)
    prefix = PACKAGE_DIR.parent  # the python folder holding the package
    for _ in pydir.parts:
        prefix = prefix.parent
    return prefix


def _libdirs(prefix):
    """Library folders of an installation under prefix: the configured one first."""
    info = _install_info()
    names = []
    if info is not None:
        names.append(info.LIBDIR)
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        names.append("lib/" + multiarch)
    names += ["lib64", "lib"]
    out = []
    for name in names:
        path = pathlib.Path(name) if os.path.isabs(name) else pathlib.Path(prefix) / name
        if path not in out:
            out.append(path)
    return out


def candidates(kind):
    """Every path tried for `kind` (a key of FILES), in order."""
    name, build_dir, lib_subdir = FILES[kind]
    paths = []
    env = os.environ.get("DYNAMIQ_PREFIX")
    if env:
        root = pathlib.Path(env)
        paths.append(root / build_dir / name)
        paths += [libdir / lib_subdir / name for libdir in _libdirs(root)]
    prefix = installed_prefix()
    if prefix is not None:
        paths += [libdir / lib_subdir / name for libdir in _libdirs(prefix)]
    checkout = PACKAGE_DIR.parent.parent
    if (checkout / "meson.build").is_file() and (checkout / "shim").is_dir():
        paths.append(checkout / "build" / build_dir / name)
    for system_prefix in SYSTEM_PREFIXES:  # a package installed by pip, dynamiq by meson install
        paths += [libdir / lib_subdir / name for libdir in _libdirs(system_prefix)]
    return [pathlib.Path(os.path.normpath(p)) for p in paths]


def _versioned(path):
    """path, else its SONAME alias (libdynamiq.so.0): a wheel holds no development symlinks."""
    if path.is_file():
        return path
    for alias in sorted(path.parent.glob(path.name + ".[0-9]*")) if path.parent.is_dir() else []:
        if alias.is_file():
            return alias
    return None


def find(kind):
    """The first existing path for `kind`; FileNotFoundError naming every path tried."""
    tried = candidates(kind)
    for path in tried:
        found = _versioned(path)
        if found is not None:
            return found
    raise FileNotFoundError(
        "%s not found; tried: %s. Set DYNAMIQ_PREFIX to a dynamiq install prefix or build "
        "directory" % (FILES[kind][0], ", ".join(str(p) for p in tried) or "nothing"))
