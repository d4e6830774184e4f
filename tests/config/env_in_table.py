"""Every DYNAMIQ_* environment variable the project's code reads is an entry of
config/settings.def, so it is validated, documented and printed like the others. Code should
read the table (config::global()/current()); this catches a read that bypasses it, whether the
name is passed to getenv directly or through a loop, a helper or a constant: every string
literal naming a DYNAMIQ_ variable in the C/C++/CUDA sources (tests and settings.def aside) and
in the Python package (python/dynamiq) must be a table entry."""
import pathlib
import re
import sys

# A whole string literal that is a DYNAMIQ_ name: "DYNAMIQ_X" (C/C++, Python) or 'DYNAMIQ_X'
# (Python). Names inside longer messages ("set DYNAMIQ_ENABLE=1") are not reads.
LITERAL = re.compile(r'''(["'])(DYNAMIQ_[A-Z0-9_]+)\1''')


def names_in(text):
    return [m.group(2) for m in LITERAL.finditer(text)]


def sources(root):
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(root)
        if rel.parts[0] in ("tests", "subprojects") or rel.parts[0].startswith((".", "build")):
            continue
        if path.suffix in (".cc", ".h", ".cu", ".cuh") or (
                path.suffix == ".py" and rel.parts[:2] == ("python", "dynamiq")):
            yield rel, path.read_text(errors="replace")


def main():
    root = pathlib.Path(sys.argv[1])
    table = set(re.findall(r'"(DYNAMIQ_[A-Z0-9_]+)"', (root / "config/settings.def").read_text()))
    # The scan itself: a read through a loop over a list of names, and one through a helper
    # given a constant, must both be found (a check that cannot pass vacuously).
    probe = ('for (const char* k : {"DYNAMIQ_PROBE_A", "SLURM_JOB_ID"}) getenv(k);\n'
             'constexpr const char* kKey = "DYNAMIQ_PROBE_B"; read_env(kKey);\n'
             "os.environ.get('DYNAMIQ_PROBE_C')\n")
    if sorted(names_in(probe)) != ["DYNAMIQ_PROBE_A", "DYNAMIQ_PROBE_B", "DYNAMIQ_PROBE_C"]:
        print("FAIL: the scan misses indirect reads: %s" % names_in(probe))
        return 1
    read = {}
    for rel, text in sources(root):
        for key in names_in(text):
            read.setdefault(key, set()).add(str(rel))
    missing = {k: v for k, v in read.items() if k not in table}
    for key, where in sorted(missing.items()):
        print("FAIL: %s is named in %s but is not in config/settings.def" %
              (key, ", ".join(sorted(where))))
    if missing:
        return 1
    print("PASS: %d table entries; every DYNAMIQ_* name in the code outside tests is one of them "
          "(%d named)" % (len(table), len(read)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
