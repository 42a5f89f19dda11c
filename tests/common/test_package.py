"""The package face: importing mpiddp (and launch, which runs outside MPI) loads nothing heavy; the public names
still resolve."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

HEAVY = ("numpy", "torch", "mpi4py")


@pytest.mark.parametrize("modules", ["mpiddp", "mpiddp.launch.supervisor, mpiddp.launch.cli"])
def test_importing_the_package_or_launch_loads_no_numpy_mpi4py_or_torch(modules):
    code = f"import sys, {modules}; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_names_resolve_on_first_use():
    import mpiddp
    from mpiddp.script.api import init
    from mpiddp.job.collective import Dist

    assert mpiddp.init is init and mpiddp.Dist is Dist
    assert set(mpiddp.__all__) <= set(dir(mpiddp))
    with pytest.raises(AttributeError, match="no_such_name"):
        mpiddp.no_such_name  # noqa: B018


def test_comm_hook_finds_the_job_that_named_itself_current():
    from mpiddp.job import collective
    from mpiddp.job.transport import comm_hook

    with pytest.raises(RuntimeError, match="needs mpiddp's job"):
        comm_hook()
    collective.set_current(collective.solo_dist())
    try:
        state, _hook = comm_hook()
        assert state is not None
    finally:
        collective.set_current(None)


PACKAGE = REPO / "mpiddp"


def _modules() -> dict[str, Path]:
    """Every module of mpiddp by its dotted name."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The mpiddp modules one import statement loads: `from mpiddp import failure` is mpiddp.failure, and
    `from mpiddp.script.api import init` is mpiddp.script.api."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])])
    found = set()
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            found.add(f"{base}.{alias.name}")
        elif base in modules:
            found.add(base)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the mpiddp modules it imports anywhere: at the top, inside functions, under TYPE_CHECKING."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= _imported(name, path, node, modules) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: the strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_mpiddp_imports_another_both_ways():
    assert cycles(import_graph()) == []


def test_the_job_layer_imports_none_of_its_users_nor_the_elastic_engine():
    """By folder, not by carving files out: job/ serves the trainer and the script front door alike and knows nothing
    of recovery, so no module under mpiddp.job imports mpiddp.script, mpiddp.trainer or mpiddp.elastic."""
    graph = import_graph()
    above = ("mpiddp.script", "mpiddp.trainer", "mpiddp.elastic")
    upward = {name: sorted(imported for imported in imports if imported.startswith(above))
              for name, imports in graph.items() if name.startswith("mpiddp.job.")}
    assert any(name.startswith("mpiddp.script.") for name in graph)  # the finder sees the front door
    assert {name: imports for name, imports in upward.items() if imports} == {}


def _renames(path: Path) -> list[str]:
    """Calls that rename or link a file: os.replace/rename/renames/link, shutil.move, Path.rename/replace/
    hardlink_to (a one-argument .replace(target) is Path's; str.replace takes two)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        attr = node.func.attr
        path_method = attr in ("rename", "hardlink_to", "link_to") or (
            attr == "replace" and len(node.args) == 1 and not node.keywords)
        if (owner == "os" and attr in ("replace", "rename", "renames", "link")) or (
                owner == "shutil" and attr == "move") or (owner not in ("os", "shutil", "dataclasses") and path_method):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_write_then_rename_goes_through_the_one_atomic_write():
    home = PACKAGE / "atomicfile.py"
    assert _renames(home)  # the finder sees the one home's own renames
    assert [hit for path in sorted(PACKAGE.rglob("*.py")) if path != home for hit in _renames(path)] == []


MAX_LINES = 60


def _long_functions(paths: list[Path]) -> list[str]:
    functions = [(path, node) for path in paths for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [f"{path.relative_to(REPO)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in functions if node.end_lineno - node.lineno + 1 > MAX_LINES]


def test_no_function_of_the_job_or_launch_layers_is_over_60_lines():
    paths = sorted([*(PACKAGE / "job").rglob("*.py"), *(PACKAGE / "launch").rglob("*.py")])
    assert _long_functions(paths) == []


def test_no_function_of_mpiddp_is_over_60_lines():
    assert _long_functions(sorted(PACKAGE.rglob("*.py"))) == []


def _store_keys(path: Path) -> list[str]:
    """String literals and f-strings that spell a key of mpiddp's in the rendezvous store ("mpiddp/...", not a
    file of the package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            text = str(node.values[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if text.startswith("mpiddp/") and ".py" not in text:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {text!r}")
    return sorted(set(found))  # an f-string's constant part is visited again on its own


def test_every_store_key_is_spelled_in_storekeys_only():
    home = PACKAGE / "job" / "storekeys.py"
    assert [hit for path in sorted(PACKAGE.rglob("*.py")) if path != home for hit in _store_keys(path)] == []


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module but those under `if TYPE_CHECKING:` (which load nothing)."""
    skipped = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
               and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
               for statement in node.body for inner in ast.walk(statement)}
    return [node for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped]


def _imports_mpi4py(path: Path) -> bool:
    for node in _runtime_imports(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if isinstance(node, ast.ImportFrom) and node.level:  # relative: one of the package's own
            continue
        if any(name == "mpi4py" or name.startswith("mpi4py.") for name in names):
            return True
    return False


def test_mpi4py_is_imported_by_four_modules_only():
    """MPI shows in the imports of a few modules: the job layer's MPI home (mpistart, which hands MPI to the spares
    and to growing back), its typed object (collective), who-am-I (topology), and the elastic layer's fault
    tolerance (membership). Imports for type checking only do not count: they load nothing."""
    importers = {name for name, path in _modules().items() if _imports_mpi4py(path)}
    assert importers == {"mpiddp.job.mpistart", "mpiddp.job.collective", "mpiddp.job.topology",
                         "mpiddp.elastic.membership"}


def test_the_import_finder_sees_mpi4py_at_run_time_only(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mpi4py import MPI\n")
    assert not _imports_mpi4py(module)
    module.write_text("def f():\n    from mpi4py.util import pkl5\n")
    assert _imports_mpi4py(module)


ULFM_CALLS = ("Get_failed", "Shrink", "Agree", "Iagree", "Revoke", "Ack_failed", "Get_acked", "Failure_ack",
              "Failure_get_acked")


def _ulfm_calls(path: Path) -> list[str]:
    """Where a module names one of MPI's fault-tolerance (ULFM) operations as an attribute (comm.Shrink(), ...)."""
    return [f"{path.relative_to(REPO)}:{node.lineno}: {node.attr}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in ULFM_CALLS]


def test_mpis_fault_tolerance_is_called_in_the_elastic_layer_only():
    """The job layer knows nothing of recovery: it learns which peers failed through the query the elastic layer
    installs (mpiddp.job.collective.set_failed_ranks_query)."""
    elastic = PACKAGE / "elastic"
    assert _ulfm_calls(elastic / "membership.py")  # the finder sees the one home's own calls
    outside = [hit for path in sorted(PACKAGE.rglob("*.py")) if elastic not in path.parents
               for hit in _ulfm_calls(path)]
    assert outside == []


MUTABLE_LITERALS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


# calls whose value never changes: what a module may bind at its top level
IMMUTABLE_CALLS = {"TypeVar", "getLogger", "frozenset", "tuple", "NewType"}


def _call_name(node: ast.expr) -> str:
    func = node.func if isinstance(node, ast.Call) else None
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _module_level_mutables(path: Path) -> list[str]:
    """Module-level state: names bound at the top to a list, dict or set literal or to a new object (a call, but
    for the immutable ones), names a function rebinds (`global`), and function defaults that are a mutable
    literal. Literal constants (numbers, strings, tuples) and type aliases are not state."""
    tree = ast.parse(path.read_text())
    where = path.relative_to(REPO) if REPO in path.parents else path.name
    found = []
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets, value = (node.targets if isinstance(node, ast.Assign) else [node.target]), node.value
        if all(isinstance(t, ast.Name) and t.id.startswith("__") and t.id.endswith("__") for t in targets):
            continue  # __all__: the module's declared names, read by import machinery only
        if isinstance(value, MUTABLE_LITERALS) or (isinstance(value, ast.Call)
                                                   and _call_name(value) not in IMMUTABLE_CALLS):
            found.append(f"{where}:{node.lineno}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{where}:{node.lineno} (global {', '.join(node.names)})")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
            found += [f"{where}:{d.lineno} (a default)" for d in defaults
                      if isinstance(d, MUTABLE_LITERALS)]
    return found


def test_the_mutable_state_finder_sees_a_module_list_an_object_a_global_and_a_mutable_default(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("A = (1, 2)\n_held: list[int] = []\ndef f(x={}, *, y=None):\n    global A\n    local = []\n"
                      "NAMES = {1}\n__all__ = ['f']\nT = TypeVar('T')\nlog = logging.getLogger('x')\n"
                      "HELD = Holder()\nFIXED = frozenset({1})\n")
    assert [hit.split(":", 1)[1] for hit in _module_level_mutables(module)] == [
        "2", "6", "10", "3 (a default)", "4 (global A)"]


def test_the_elastic_layer_keeps_no_module_level_mutable_state():
    """Its state lives in objects handed to whoever uses them, not in module globals."""
    hits = [hit for path in sorted((PACKAGE / "elastic").rglob("*.py")) for hit in _module_level_mutables(path)]
    assert hits == []
