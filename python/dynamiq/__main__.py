"""python3 -m dynamiq library-path [shim|plugin|capi|cpu-nccl] | version

    LD_PRELOAD=$(python3 -m dynamiq library-path) DYNAMIQ_ENABLE=1 torchrun ... train.py
"""

import sys

import dynamiq


def main(argv):
    if argv[:1] == ["version"] and len(argv) == 1:
        print(dynamiq.__version__)
        return 0
    if argv[:1] == ["library-path"] and len(argv) <= 2:
        try:
            print(dynamiq.library_path(*argv[1:]))
        except (FileNotFoundError, ValueError) as e:
            print("dynamiq: %s" % e, file=sys.stderr)
            return 1
        return 0
    print(__doc__.strip(), file=sys.stderr if argv not in (["-h"], ["--help"]) else sys.stdout)
    return 0 if argv in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
