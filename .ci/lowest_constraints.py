"""Print pip constraints pinning every dependency of a plain `pip install remesh` to the lowest version
pyproject.toml declares (">=X" becomes "==X"), for the lowest-versions check (`make lowest`)."""

import re
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
for requirement in project["dependencies"]:
    match = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)\s*>=\s*([^,;\s]+)", requirement)
    if match is None:
        raise SystemExit(f"no lower bound to pin in {requirement!r}: declare one with >=")
    name = match.group(1).split("[")[0]
    print(f"{name}=={match.group(2)}")
