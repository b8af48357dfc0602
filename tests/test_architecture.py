"""The layer edges of the README's "Code layout", checked on every import of the package: a change
that crosses one fails here rather than in review."""

import ast
from pathlib import Path

import pytest

from encoder_service.models.registry import FAMILY_PACKAGES, families

PACKAGE = Path(__file__).resolve().parent.parent / "encoder_service"

# Below the API nothing speaks gRPC: the engine and the models are usable without a server.
WIRE = ("grpc", "google.protobuf", "encoder_client._proto", "encoder_service.api")
BELOW_API = ("engine", "models", "preprocess", "attention", "metadata")
BELOW_ENGINE = ("models", "preprocess", "attention", "metadata")
BELOW_MODELS = ("preprocess", "attention", "metadata")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module a file imports (relative imports resolved), at any depth of the file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _files(*layers: str) -> list[Path]:
    out = []
    for layer in layers:
        target = PACKAGE / layer
        out += sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]
    return out


def _violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in files:
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return bad


def test_import_walk_sees_relative_imports():
    # The checks below are only as good as this resolution: models/qwen2_5_vl/model.py reaches
    # the attention package through "from ...attention import".
    names = _imports(PACKAGE / "models" / "qwen2_5_vl" / "model.py")
    assert "encoder_service.attention" in names
    assert "encoder_service.models.base" in names


def test_nothing_below_the_api_speaks_grpc():
    assert _violations(_files(*BELOW_API), WIRE) == []


def test_models_and_what_they_use_never_reach_up_to_the_engine():
    assert _violations(_files(*BELOW_ENGINE), ("encoder_service.engine",)) == []


def test_preprocessing_metadata_and_attention_do_not_know_the_models():
    assert _violations(_files(*BELOW_MODELS), ("encoder_service.models",)) == []


def test_a_family_package_is_reached_only_through_the_registry():
    # bench.py times the Qwen2.5-VL tower's building blocks; it is a tool, not a serving path.
    outside = [p for p in PACKAGE.rglob("*.py")
               if not any(p.is_relative_to(PACKAGE.parent / pkg.replace(".", "/")) for pkg in FAMILY_PACKAGES)
               and p.name != "bench.py"]
    assert _violations(outside, FAMILY_PACKAGES) == []


@pytest.mark.parametrize("family", families(), ids=lambda f: f.model_types[0])
def test_no_code_outside_a_family_branches_on_its_model_type(family):
    mine = PACKAGE.parent / family.__module__.replace(".", "/")
    hits = []
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(mine):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in family.model_types:
                hits.append(f"{path.relative_to(PACKAGE)}:{node.lineno} names {node.value!r}")
    assert hits == []
