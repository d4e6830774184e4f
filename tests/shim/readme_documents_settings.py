#!/usr/bin/env python3
"""Every setting in config/settings.def is documented in README.md's settings table, with the
same default. Usage: readme_documents_settings.py SOURCE_ROOT"""
import re
import sys

root = sys.argv[1]
table = open(f"{root}/config/settings.def").read()
readme = open(f"{root}/README.md").read()
entries = re.findall(r'DQ_SETTING\(\w+, \w+, "(DYNAMIQ_\w+)", "([^"]*)"', table)
if len(entries) < 10:
    sys.exit(f"FAIL: parsed only {len(entries)} settings from settings.def")
missing = []
for key, default in entries:
    row = re.search(r"^\| `" + key + r"` \| ([^|]*) \|", readme, re.M)
    if not row:
        missing.append(f"{key}: no row in README.md")
        continue
    shown = row.group(1).strip()
    want = f"`{default}`" if default else "(none)"
    if shown != want:
        missing.append(f"{key}: README says {shown}, settings.def says {want}")
if missing:
    sys.exit("FAIL:\n" + "\n".join(missing))
print(f"PASS: {len(entries)} settings documented with their defaults")
