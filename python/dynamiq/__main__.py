"""usage: python3 -m dynamiq COMMAND

  run [--] PROGRAM [ARGS...]   run PROGRAM with dynamiq preloaded: LD_PRELOAD gains
                               libdynamiq.so, the net plugin's folder goes on LD_LIBRARY_PATH
                               (for NCCL_NET_PLUGIN=dynamiq), the tools' folder on PATH, and
                               DYNAMIQ_ENABLE=1 unless set
  env                          print that environment as shell `export` lines
  library-path [shim|plugin|capi|cpu-nccl]   path of a library
  data-path                    folder of the installed data (gradients/sample/step00079.npy)
  --version, version           print the version

    python3 -m dynamiq run -- torchrun --nproc_per_node=8 train.py
    LD_PRELOAD=$(python3 -m dynamiq library-path) DYNAMIQ_ENABLE=1 torchrun ... train.py
"""

import os
import shlex
import sys

import dynamiq
from dynamiq import _tools


def _run(argv):
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("dynamiq run: no program given\n\n" + __doc__.strip(), file=sys.stderr)
        return 2
    env = _tools.job_environment()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print("dynamiq run: cannot run %s: %s" % (argv[0], e.strerror), file=sys.stderr)
        return 127


def main(argv):
    if argv in (["version"], ["--version"]):
        print(dynamiq.__version__)
        return 0
    try:
        if argv[:1] == ["run"]:
            return _run(argv[1:])
        if argv == ["env"]:
            env = _tools.job_environment()
            for key in ("LD_PRELOAD", "LD_LIBRARY_PATH", "PATH", "DYNAMIQ_ENABLE"):
                print("export %s=%s" % (key, shlex.quote(env[key])))
            return 0
        if argv[:1] == ["library-path"] and len(argv) <= 2:
            print(dynamiq.library_path(*argv[1:]))
            return 0
        if argv == ["data-path"]:
            print(_tools.data_dir())
            return 0
    except (FileNotFoundError, ValueError) as e:
        print("dynamiq: %s" % e, file=sys.stderr)
        return 1
    print(__doc__.strip(), file=sys.stderr if argv not in (["-h"], ["--help"]) else sys.stdout)
    return 0 if argv in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
