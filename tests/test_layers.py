"""The package's layering, read from the source: no import circle inside ``nctv`` (function-level
imports included, since they run too), and the web app reached only through ``app.py``."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports, anywhere in it but under ``if TYPE_CHECKING``.

    ``from package import submodule`` counts as importing the submodule: a package is loaded before
    each of its modules anyway, which is no circle."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            out.update(subs if len(subs) == len(node.names) else [node.module, *subs])
    return out & known


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in (REPO / "nctv").rglob("*.py")}
    known = set(files)
    return {name: _imports(path, known) - {name} for name, path in files.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_nctv():
    graph = _graph()
    assert "nctv.calibration.clamping" in graph and graph["nctv.calibration.clamping"], "the graph is empty"
    assert _circles(graph) == []


def _imports_the_app(source: str) -> bool:
    """Whether ``source`` imports ``nctv.ui`` or one of its modules, at any level of the code."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    return any(n == "nctv.ui" or n.startswith("nctv.ui.") for n in names)


def test_the_app_import_finder_sees_every_form():
    assert _imports_the_app("def f():\n    from nctv.ui.caches import get_model\n")
    assert _imports_the_app("from nctv import ui") and _imports_the_app("import nctv.ui.calibrate as c")
    assert not _imports_the_app("from nctv import experiment\nimport nctv.uix")


def test_only_app_py_imports_the_web_app():
    """The library, the command line, the bench and the scripts reach the engine without Gradio:
    outside nctv/ui/, only app.py imports nctv.ui."""
    ui = REPO / "nctv" / "ui"
    sources = [REPO / "app.py", *(p for folder in ("nctv", "scripts", "bench") for p in (REPO / folder).rglob("*.py"))]
    importers = sorted(str(p.relative_to(REPO)) for p in sources
                       if ui not in p.parents and _imports_the_app(p.read_text(encoding="utf-8")))
    assert importers == ["app.py"]
