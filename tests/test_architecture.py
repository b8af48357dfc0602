"""The layer edges of the README's "Code layout", checked on every import of the package: a change
that crosses one fails here rather than in review."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

from encoder_service.models.registry import FAMILY_PACKAGES, families

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "encoder_service"
PROTOCOL = ROOT / "client" / "encoder_client" / "protocol"
PRIVATE_STUBS = "encoder_client._proto"

# Below the API nothing speaks gRPC: the engine and the models are usable without a server. They may
# use the protocol's dtype table and hashing (encoder_client.protocol.dtypes/.hashing), not its stubs.
WIRE = ("grpc", "google.protobuf", PRIVATE_STUBS, "encoder_client.protocol.stubs",
        "encoder_client.protocol.encoder_pb2", "encoder_client.protocol.encoder_pb2_grpc", "encoder_service.api")
BELOW_API = ("engine", "models", "preprocess", "attention", "ops", "metadata")
BELOW_ENGINE = ("models", "preprocess", "attention", "ops", "metadata")
BELOW_MODELS = ("preprocess", "attention", "ops", "metadata")
# The kernel libraries: only the ops layer's providers and the attention backends call into them.
KERNEL_LIBRARIES = ("triton", "flashinfer", "aiter")


def _module_name(path: Path) -> str:
    # The client's modules are named from client/ (its distribution's root), the rest from the repository.
    root = next((r for r in (ROOT / "client", ROOT) if path.is_relative_to(r)), path.parent)
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module a file imports (relative imports resolved), at any depth of the file."""
    return _imports_as(path, path)


def _imports_as(path: Path, location: Path) -> set[str]:
    """``_imports`` of the source at ``path`` as if it lived at ``location``."""
    module = _module_name(location)
    package = module if location.name == "__init__.py" else module.rsplit(".", 1)[0]
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
                shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                bad.append(f"{shown} imports {name}")
    return bad


def test_import_walk_sees_relative_imports():
    # The checks below are only as good as this resolution: models/qwen2_5_vl/model.py reaches
    # the attention package through "from ...attention import".
    names = _imports(PACKAGE / "models" / "qwen2_5_vl" / "model.py")
    assert "encoder_service.attention" in names
    assert "encoder_service.models.base" in names


def test_nothing_below_the_api_speaks_grpc():
    assert _violations(_files(*BELOW_API), WIRE) == []


def test_the_api_never_touches_torch():
    # The engine hands the API embedding bytes (ImageResult.wire_bytes), not tensors.
    assert _violations(_files("api"), ("torch",)) == []


def test_models_and_what_they_use_never_reach_up_to_the_engine():
    assert _violations(_files(*BELOW_ENGINE), ("encoder_service.engine",)) == []


def test_preprocessing_metadata_and_attention_do_not_know_the_models():
    assert _violations(_files(*BELOW_MODELS), ("encoder_service.models",)) == []


def _family_names() -> set[str]:
    """What a family's names start with: the letters of its model_types (qwen, kimi)."""
    return {re.match("[a-z]*", t).group() for family in families() for t in family.model_types} - {""}


def test_the_shared_preprocessing_and_metadata_hold_no_family():
    # Each family's image processing and host metadata live in its package
    # (models/<family>/preprocess.py, metadata.py); preprocess/ and metadata.py keep what more than one
    # family uses, so no module or top-level name there is a family's.
    stems = _family_names()
    assert stems >= {"qwen", "kimi"}
    hits = []
    for path in _files("preprocess", "metadata"):
        named = [path.stem] + [node.name for node in ast.parse(path.read_text()).body
                               if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
        named += [target.id for node in ast.parse(path.read_text()).body if isinstance(node, ast.Assign)
                  for target in node.targets if isinstance(target, ast.Name)]
        hits += [f"{path.relative_to(PACKAGE)}: {name}" for name in named if any(s in name.lower() for s in stems)]
    assert hits == []


def test_a_familys_preprocessing_and_metadata_stay_below_the_models():
    # Moved from preprocess/ and metadata.py into the family packages, they keep that layer's edges: the
    # shared preprocessing and metadata, errors, and another family's preprocess/metadata they build on;
    # not the model contract, attention, ops, the engine.
    allowed = ("encoder_service.errors", "encoder_service.preprocess", "encoder_service.metadata")
    moved = [p for pkg in FAMILY_PACKAGES for p in sorted((PACKAGE.parent / pkg.replace(".", "/")).glob("*.py"))
             if p.stem in ("preprocess", "metadata")]
    assert {p.relative_to(PACKAGE).as_posix() for p in moved} >= {
        "models/qwen2_5_vl/preprocess.py", "models/kimi_k25/preprocess.py", "models/kimi_k25/metadata.py"}
    modules = _modules()
    bad = []
    for path in moved:
        for name in _imports(path):
            module = _module_of(name, modules)
            if module is None or module in allowed or module.startswith("encoder_service.preprocess."):
                continue
            if module.rpartition(".")[2] in ("preprocess", "metadata") and module.startswith("encoder_service.models."):
                continue
            bad.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert bad == []


def test_models_never_name_a_kernel():
    # A model asks the ops layer for a capability (``from ...ops import select_ops``): it imports the
    # package, never a module under it (a provider, a kernel), nor a kernel library. The attention
    # backends are reached through attention.select_backend alike, never by module.
    ops_modules = tuple(f"encoder_service.ops.{p.stem}" for p in (PACKAGE / "ops").glob("*.py")
                        if p.stem != "__init__")
    backends = tuple(f"encoder_service.attention.{p.stem}" for p in (PACKAGE / "attention").glob("*.py")
                     if p.stem not in ("__init__", "base"))
    assert "encoder_service.ops.triton_window" in ops_modules and "encoder_service.attention.sdpa" in backends
    assert _violations(_files("models"), ops_modules + backends + KERNEL_LIBRARIES) == []


def test_the_walk_catches_a_model_importing_a_kernel(tmp_path):
    bad = PACKAGE / "models" / "qwen2_5_vl" / "_bad_probe.py"  # named inside models/ so relative imports resolve
    for source, name in (("from ...ops import triton_window", "encoder_service.ops.triton_window"),
                         ("from ...ops._rms_kernel import rms_scale", "encoder_service.ops._rms_kernel"),
                         ("import triton.language as tl", "triton.language")):
        probe = tmp_path / "probe.py"
        probe.write_text(source + "\n")
        found = {n for n in _imports_as(probe, bad)}
        assert name in found, (source, found)


def test_the_kernels_live_in_the_ops_layer_only():
    # attention/ keeps attention backends; fused kernels (triton.jit) are ops providers' kernels.
    jit = [p for p in PACKAGE.rglob("*.py") if "@triton.jit" in p.read_text() and not p.is_relative_to(PACKAGE / "ops")]
    assert jit == []


def test_a_family_package_is_reached_only_through_the_registry():
    # benchmarks/forward.py times the Qwen2.5-VL tower's building blocks; it is a tool, not a serving path.
    outside = [p for p in PACKAGE.rglob("*.py")
               if not any(p.is_relative_to(PACKAGE.parent / pkg.replace(".", "/")) for pkg in FAMILY_PACKAGES)
               and p != PACKAGE / "benchmarks" / "forward.py"]
    assert _violations(outside, FAMILY_PACKAGES) == []


def _modules() -> dict[str, Path]:
    """Every module of the package by name."""
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _module_of(name: str, modules: dict[str, Path]) -> str | None:
    """The package module an imported name lives in: the name itself or its longest prefix that is one."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_modules(path: Path, modules: dict[str, Path], location: Path | None = None) -> set[str]:
    """The package's modules that a file's imports (``_imports``, at any depth) run. ``from P import sub``,
    ``sub`` a module, counts as an import of ``P.sub`` only: P's ``__init__`` runs before any module under
    it anyway, so only a name taken from P itself (``from P import f``, ``import P``) makes an edge to it."""
    names = _imports_as(path, location or path)
    found = {m for m in (_module_of(n, modules) for n in names) if m is not None}
    for package in list(found):
        below = [n for n in names if n.startswith(package + ".")]
        if below and all(_module_of(n, modules) != package for n in below):
            found.discard(package)
    found.discard(_module_name(location or path))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """One cycle per back edge of a depth-first walk (none found: the graph has no cycle)."""
    state: dict[str, str] = {}
    stack: list[str] = []
    found: list[str] = []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_cycle_check_sees_a_cycle_and_a_lazy_import(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    modules = _modules()
    # The circle the checkpoint reader once closed (family -> loader -> registry -> family) went
    # through an import inside a function: the walk counts it.
    probe = tmp_path / "probe.py"
    probe.write_text("def read_checkpoint(path):\n    from .registry import family_for\n")
    assert "encoder_service.models.registry" in _imported_modules(probe, modules, PACKAGE / "models" / "loader.py")
    # A submodule taken from its package is an edge to the submodule, not to the package's __init__.
    probe.write_text("from . import folded\nfrom ..base import VisionModel\n")
    assert _imported_modules(probe, modules, PACKAGE / "models" / "qwen2_5_vl" / "model.py") == {
        "encoder_service.models.qwen2_5_vl.folded", "encoder_service.models.base"}


def test_no_import_cycle_among_the_package_modules():
    # Module by module over the whole package, imports at any depth (a lazy import closes a circle too).
    modules = _modules()
    graph = {name: _imported_modules(path, modules) for name, path in modules.items()}
    assert "encoder_service.models.loader" in graph["encoder_service.models.family"]
    assert _cycles(graph) == []


# What a family package may import outside itself: the shared contract. The models' contract
# (family.py, base.py and what it re-exports from spec.py, layers.py, the checkpoint reader loader.py,
# cuda_graphs.py, video_hooks.py's FamilyVideo and VideoFront), the ops and attention packages (never a
# module under them: test_models_never_name_a_kernel), the shared metadata, errors and the device helpers;
# and any module of the shared preprocess/ package.
SHARED_CONTRACT = ("encoder_service.errors", "encoder_service.device", "encoder_service.metadata",
                   "encoder_service.attention", "encoder_service.ops", "encoder_service.models.family",
                   "encoder_service.models.base", "encoder_service.models.spec", "encoder_service.models.layers",
                   "encoder_service.models.loader", "encoder_service.models.cuda_graphs",
                   "encoder_service.models.video_hooks")
# Another family's modules a family builds on: Qwen3-VL is fed by Qwen2-VL's image processor, and its
# video processor shares Qwen2-VL's video patch layout.
BUILDS_ON = {
    "encoder_service.models.qwen3_vl": ("encoder_service.models.qwen2_5_vl.preprocess",
                                        "encoder_service.models.qwen2_5_vl.processor",
                                        "encoder_service.models.qwen2_5_vl.video"),
}


def _imports_outside(package: str) -> set[str]:
    """The package modules that the files of a family package import outside the package."""
    modules = _modules()
    root = PACKAGE.parent / package.replace(".", "/")
    return {m for path in root.rglob("*.py") for m in _imported_modules(path, modules)
            if m != package and not m.startswith(package + ".")}


@pytest.mark.parametrize("package", FAMILY_PACKAGES, ids=lambda p: p.rsplit(".", 1)[1])
def test_a_family_package_imports_only_the_shared_contract(package):
    # README "Adding a model family": a family is its package plus one line in registry.py. So
    # the package needs nothing from outside but the shared contract (and the modules of a family it
    # builds on); nothing outside reaches into it but the registry
    # (test_a_family_package_is_reached_only_through_the_registry).
    outside = _imports_outside(package)
    assert "encoder_service.models.family" in outside  # the walk sees the package's imports
    allowed = SHARED_CONTRACT + BUILDS_ON.get(package, ())
    shared_preprocessing = [m for m in outside if m.split(".")[:2] == ["encoder_service", "preprocess"]]
    assert sorted(outside - set(allowed) - set(shared_preprocessing)) == []


def test_the_qwen3_vl_package_imports_the_contract_and_qwen2_vl_processing_only():
    # The newest family, listed in full: what adding a family takes from the rest of the code.
    assert _imports_outside("encoder_service.models.qwen3_vl") == {
        "encoder_service.errors", "encoder_service.device", "encoder_service.metadata", "encoder_service.attention",
        "encoder_service.models.family", "encoder_service.models.base", "encoder_service.models.layers",
        "encoder_service.models.loader", "encoder_service.models.video_hooks", "encoder_service.models.cuda_graphs",
        "encoder_service.models.qwen2_5_vl.preprocess", "encoder_service.models.qwen2_5_vl.processor",
        "encoder_service.models.qwen2_5_vl.video", "encoder_service.preprocess.video_sampling",
        "encoder_service.preprocess.settings", "encoder_service.preprocess.decode", "encoder_service.ops",
    }
    assert "encoder_service.models.qwen3_vl" in FAMILY_PACKAGES


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


def _python_files() -> list[Path]:
    """Every Python file of the repository: the server, the client, tests, benches, scripts, examples.
    In a git checkout, what git tracks or would (not what it ignores: a local export of an older tree)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode == 0:
        return sorted(ROOT / line for line in listed.stdout.splitlines() if (ROOT / line).is_file())
    skip = {".venv", ".git", "node_modules", "build", "dist"}
    return sorted(p for p in ROOT.rglob("*.py") if not skip.intersection(p.relative_to(ROOT).parts))


def test_the_generated_stubs_are_imported_only_through_the_protocol_module():
    # encoder_client._proto is where gen_protos.py writes; encoder_client.protocol is the public face
    # that client and server share. The generated files import each other, and nothing else may.
    stubs = ROOT / "client" / "encoder_client" / "_proto"
    outside = [p for p in _python_files() if not p.is_relative_to(PROTOCOL) and not p.is_relative_to(stubs)]
    assert len(outside) > 100  # the walk sees the whole tree
    assert _violations(outside, (PRIVATE_STUBS,)) == []


@pytest.mark.parametrize("source", ["from encoder_client._proto.encoder.v1 import encoder_pb2",
                                    "import encoder_client._proto.encoder.v1.encoder_pb2_grpc",
                                    "def f():\n    from encoder_client import _proto"])
def test_the_private_stubs_check_sees_every_form_of_import(tmp_path, source):
    bad = tmp_path / "bad.py"
    bad.write_text(source + "\n")
    assert _violations([bad], (PRIVATE_STUBS,)) != []


def test_the_sglang_front_end_never_reaches_into_the_vision_encoder_servicer():
    # Both front ends reach the engine through api/engine_gate.py; neither calls the other.
    sglang = _files("api/sglang")
    assert len(sglang) >= 5  # the walk sees the package
    assert _violations(sglang, ("encoder_service.api.servicer",)) == []


def test_the_metrics_speak_no_grpc():
    # The status codes are named in encoder_service/errors.py; their grpc.StatusCode is the API's business.
    assert _violations([PACKAGE / "metrics.py"], ("grpc",)) == []


def test_the_status_names_below_the_api_are_grpcs():
    import grpc

    from encoder_service.errors import STATUS_CODES

    assert tuple(code.name for code in grpc.StatusCode) == STATUS_CODES


@pytest.mark.parametrize("package", FAMILY_PACKAGES)
def test_a_familys_video_lives_in_its_package(package):
    # Its video.py declares the family's whole video side (VIDEO), and its model takes exactly that: the
    # shared VideoHooks derive the rest, so no family's video is wired anywhere else.
    import importlib

    from encoder_service.models.base import VisionModel
    from encoder_service.models.video_hooks import FamilyVideo

    video = importlib.import_module(f"{package}.video")
    assert isinstance(video.VIDEO, FamilyVideo)
    model = importlib.import_module(f"{package}.model")
    classes = [c for c in vars(model).values()
               if isinstance(c, type) and issubclass(c, VisionModel) and c.__module__ == model.__name__]
    assert classes and all(c.VIDEO is video.VIDEO for c in classes), classes


def _names(path: Path) -> set[str]:
    """Every name a file's code uses or imports (docstrings and comments aside)."""
    tree = ast.parse(path.read_text())
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    used |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    used |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    return used


def test_only_the_api_assembly_holds_the_whole_service_config():
    # Each API component gets its config group (requests, security, relays); api/server.py builds them.
    api = _files("api")
    holders = sorted(str(p.relative_to(PACKAGE)) for p in api if "ServiceConfig" in _names(p))
    assert holders == ["api/server.py"]
