"""Print the requirements of the package and of the given extras, one a line, from pyproject.toml.
An image installs them before it copies the sources, so a change to the sources reuses that layer.

    python3 requirements.py PYPROJECT EXTRA[,EXTRA...]
"""

import sys
import tomllib

with open(sys.argv[1], "rb") as file:
    project = tomllib.load(file)["project"]
extras = [extra for extra in sys.argv[2].split(",") if extra]
print("\n".join(project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]))
