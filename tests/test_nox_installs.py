"""``nox -s demo`` installs what the demo runs on, and nothing of the tests (issue 59 item 1).

The demo's requirements (the noxfile's DEMO_DEPS) must be exactly the
distributions its code imports (examples/train_digits.py and the modules of
examples/ it reaches), the runtime dependencies of the six packages, and the
MPI: a test tool added to them, or a library the demo starts to import without
its being added, fails here. The noxfile is read, not imported (nox is not
installed in the test sessions).
"""

from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
NOXFILE = ROOT / "noxfile.py"
EXAMPLES = ROOT / "examples"
DEMO = EXAMPLES / "train_digits.py"
PACKAGES = ["launch", "collectives", "quantize", "mgrit", "pipeline", "dataparallel"]
# The MPI the sessions run on: a library and mpiexec, imported by no module.
MPI = "mpich"


def _noxfile_lists() -> dict[str, list[str]]:
    """The noxfile's module-level ``*_DEPS`` lists, as its assignments build them."""
    tree = ast.parse(NOXFILE.read_text())
    nodes: list[ast.stmt] = []
    for node in tree.body:
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            else node.target
            if isinstance(node, ast.AugAssign)
            else None
        )
        if isinstance(target, ast.Name) and target.id.endswith("_DEPS"):
            nodes.append(node)
    namespace: dict[str, object] = {"__builtins__": {}}
    # List literals, unpackings of each other and +=: nothing else to evaluate.
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(NOXFILE), "exec"), namespace)
    lists: dict[str, list[str]] = {}
    for name, value in namespace.items():
        if name.endswith("_DEPS"):
            assert isinstance(value, list), (name, value)
            lists[name] = [str(requirement) for requirement in value]
    return lists


def _session(name: str) -> ast.FunctionDef:
    for node in ast.parse(NOXFILE.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"noxfile.py has no session function {name}")


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def _demo_imports() -> set[str]:
    """Top-level modules the demo imports, outside examples/: its own modules followed."""
    seen, todo, outside = set(), [DEMO], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for root in _imported_roots(path):
            if (EXAMPLES / f"{root}.py").is_file():
                todo.append(EXAMPLES / f"{root}.py")
            elif root != "examples":  # mypy's name of this folder (TYPE_CHECKING only)
                outside.add(root)
    return outside


def _runtime_distributions() -> set[str]:
    """What the demo needs: the distributions it imports, the packages' dependencies, the MPI."""
    of_module = metadata.packages_distributions()
    needed = {canonicalize_name(MPI)}
    for root in _demo_imports() - set(sys.stdlib_module_names) - {"mpx"}:
        assert root in of_module, f"the demo imports {root}, which no installed distribution has"
        needed |= {canonicalize_name(name) for name in of_module[root]}
    for package in PACKAGES:
        with (ROOT / "packages" / package / "pyproject.toml").open("rb") as file:
            declared = tomllib.load(file)["project"]["dependencies"]
        needed |= {canonicalize_name(Requirement(text).name) for text in declared}
    return {name for name in needed if not name.startswith("mpx-")}


def test_the_demo_installs_exactly_what_it_runs_on() -> None:
    demo = {canonicalize_name(name) for name in _noxfile_lists()["DEMO_DEPS"]}
    assert demo == _runtime_distributions(), (
        f"DEMO_DEPS {sorted(demo)}: not what the demo imports and the packages need "
        f"({sorted(_runtime_distributions())})"
    )


def test_the_test_tools_stay_in_the_tests_lists_only() -> None:
    lists = _noxfile_lists()
    tools = set(lists["TEST_DEPS"]) - set(lists["DEMO_DEPS"])
    # The tests' own tools are still installed for the test sessions.
    assert {"pytest", "pytest-xdist", "pymgrit", "lightning"} <= tools, tools
    assert set(lists["DEMO_DEPS"]) <= set(lists["TEST_DEPS"])


def test_the_demo_session_installs_demo_deps_and_nothing_else() -> None:
    calls = [
        node
        for node in ast.walk(_session("demo"))
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id.startswith("_install"))
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "install")
        )
    ]
    assert len(calls) == 1, f"the demo session installs in {len(calls)} calls"
    (call,) = calls
    deps = {k.arg: k.value for k in call.keywords}.get("deps")
    assert isinstance(deps, ast.Name), ast.unparse(call)
    assert deps.id == "DEMO_DEPS", ast.unparse(call)
    # Only the session itself: an extra requirement would bypass DEMO_DEPS.
    assert len(call.args) == 1, ast.unparse(call)
