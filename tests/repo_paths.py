"""Where the repository is, from the tests' side: its root, its scripts imported from their files, and the
programs the operations tests run. A plain module (``from repo_paths import REPO_ROOT``): tests/ is on the
path (the rootdir conftest), and a name imported from ``conftest`` would be whichever conftest.py
pytest loaded last."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def import_script(relative_path: str):
    """A script of the repository (``bench/soak.py``) imported from its file: bench/ holds scripts, not a
    package on the path."""
    path = REPO_ROOT / relative_path
    name = path.stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# --- tools the operations tests run (scripts/ci_tools.sh installs them) ---------------------------------


def find_tool(name: str) -> str | None:
    """A program on PATH or beside this Python (the .venv's bin, also when the venv is not activated)."""
    import shutil

    return shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
