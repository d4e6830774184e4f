"""Every DYNAMIQ_* environment variable the project's code reads directly (getenv) is an entry
of config/settings.def, so it is validated, documented and printed like the others. Code should
read the table (config::global()/current()); this catches a getenv that bypasses it."""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
table = set(re.findall(r'"(DYNAMIQ_[A-Z0-9_]+)"', (root / "config/settings.def").read_text()))
read = {}
for path in root.rglob("*"):
    if path.suffix not in (".cc", ".h", ".cu") or not path.is_file():
        continue
    rel = path.relative_to(root)
    if rel.parts[0] in ("tests", "build") or rel.parts[0].startswith((".", "build")):
        continue
    for key in re.findall(r'getenv\(\s*"(DYNAMIQ_[A-Z0-9_]+)"', path.read_text(errors="replace")):
        read.setdefault(key, []).append(str(rel))
missing = {k: v for k, v in read.items() if k not in table}
for key, where in sorted(missing.items()):
    print(f"FAIL: {key} is read with getenv in {', '.join(where)} but is not in config/settings.def")
if missing:
    sys.exit(1)
print(f"PASS: {len(table)} table entries; every DYNAMIQ_* getenv outside tests is one of them "
      f"({len(read)} read directly)")
