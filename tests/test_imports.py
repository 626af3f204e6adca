"""The import graph of the project's packages, read from the source (no import is run):
models/ imports no other package of the project and des_ops/ only models/; the modules' top-level
imports form no cycle; imports of the project's own modules sit at the top of files, except the
few kept lazy on purpose (des's public API, des_ops' communicator names, the mode registry and the
hooks that pick a communicator or fuse tables, and des.train's option parsing, so that a wrong
option stops before TensorFlow loads)."""
import ast
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("des", "des_ops", "models", "rewrite_rules")
LAZY = {"des": 8, "des.jobs.train": 2, "des.jobs.modes": 2, "des.jobs.modes.base": 2, "des_ops": 1}   # module -> at most


def _modules() -> dict[str, ast.Module]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = ast.parse(path.read_text())
    return out


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The project modules an import statement names (``from a import b``: a.b if that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")[:len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(parts + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def _imports(modules: dict[str, ast.Module], every: bool = False) -> tuple[dict[str, set[str]], dict[str, list[int]]]:
    """(top-level edges module -> project modules, function-level import lines per module).
    Imports under ``if TYPE_CHECKING:`` are not edges (they never run); with ``every``, they and
    function-level imports are edges too (the file-level graph)."""
    top, inner = {}, {}
    for name, tree in modules.items():
        is_package = (ROOT / name.replace(".", "/") / "__init__.py").exists()
        top[name] = set()
        nested = {id(s) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for s in ast.walk(f)}
        typing_only = {id(s) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n.test)
                       for s in ast.walk(n)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or (id(node) in typing_only and not every):
                continue
            names = [t for t in _targets(node, name, is_package) if t.split(".")[0] in PACKAGES]
            if names and id(node) in nested and not every:
                inner.setdefault(name, []).append(node.lineno)
            elif names:
                top[name] |= {t for t in names if t in modules and t != name}
    return top, inner


def _cycle(top: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the top-level import graph, or None. (A package's __init__ importing its own
    modules is no edge back: Python runs the __init__ first, and it is no cycle unless a module reads
    a name of the package, which is an edge here.)"""
    edges = top
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t, path + [t])):
                return found
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_lower_packages_import_nothing_above_them():
    top, _ = _imports(_modules())
    allowed = {"models": {"models"}, "des_ops": {"des_ops", "models"}}
    bad = {m: sorted(t for t in targets if t.split(".")[0] not in allowed[m.split(".")[0]])
           for m, targets in top.items() if m.split(".")[0] in allowed}
    assert not {m: t for m, t in bad.items() if t}


def test_top_level_imports_form_no_cycle():
    top, _ = _imports(_modules())
    assert _cycle(top) is None, "import cycle: " + " -> ".join(_cycle(top))


def test_imports_sit_at_the_top_of_files():
    _, inner = _imports(_modules())
    over = {m: lines for m, lines in inner.items() if len(lines) > LAZY.get(m, 0)}
    assert not over, f"function-level imports of project modules (module: lines): {over}"


# The layers of des (shared/DESIGN.md section 8): a module may import its own layer and those to the right.
LAYERS = {
    "des.graph": ("des.graph", "des_ops", "models"),
    "rewrite_rules": ("rewrite_rules", "des.graph", "des_ops", "models"),
    "des.compiler": ("des.compiler", "rewrite_rules", "des.graph", "des.data", "des_ops", "models"),
    "des.runtime": ("des.runtime", "des.compiler", "rewrite_rules", "des.graph", "des.data", "des_ops", "models"),
    "des.data": ("des.data", "des_ops", "models"),
    "des.cluster": ("des.cluster", "des_ops", "models"),
}


def _layer_violations(edges: dict[str, set[str]]) -> dict[str, list[str]]:
    out = {}
    for m, targets in edges.items():
        layer = next((k for k in LAYERS if m == k or m.startswith(k + ".")), None)
        if layer is None:
            continue
        bad = sorted(t for t in targets if not any(t == a or t.startswith(a + ".") for a in LAYERS[layer]))
        if bad:
            out[m] = bad
    return out


def test_the_layers_import_one_way():
    """des.graph <- rewrite_rules <- des.compiler <- des.runtime <- des.jobs (and des.baselines), every
    import counted, a function's or a type checker's too: the compiler never reaches into the runtime,
    the graph layer into the compiler, nor any of them into the jobs or the package's facade."""
    every, _ = _imports(_modules(), every=True)
    assert not _layer_violations(every)
    assert _layer_violations({"des.compiler.x": {"des.runtime.state"}, "des.graph.ir": {"des"}}) == {
        "des.compiler.x": ["des.runtime.state"], "des.graph.ir": ["des"]}


def test_no_file_imports_one_that_imports_it_back():
    """No circle in the file-level graph (every import statement, lazy or for type checkers)."""
    every, _ = _imports(_modules(), every=True)
    assert _cycle(every) is None, "import circle: " + " -> ".join(_cycle(every))


def test_the_package_shows_its_rooms():
    """At most 12 modules directly in des/ (the commands and the public names; the rest in sub-packages)."""
    direct = sorted(p.name for p in (ROOT / "des").glob("*.py"))
    assert len(direct) <= 12, direct


def test_no_function_is_longer_than_80_lines():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for pkg in (*PACKAGES, "scripts") for path in sorted((ROOT / pkg).rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80]
    assert not long, long


def test_the_checks_catch_a_cycle_and_a_function_level_import():
    """Made-up modules: a -> b -> a is a cycle; an import inside a function is counted, not an edge;
    one under TYPE_CHECKING is neither."""
    fake = {"des_ops.a": ast.parse("from des_ops import b\n"),
            "des_ops.b": ast.parse("import des_ops.a\nif TYPE_CHECKING:\n    import des.graph.ir\n"
                                   "def f():\n    from models import spec\n")}
    top, inner = _imports(fake)
    assert top == {"des_ops.a": {"des_ops.b"}, "des_ops.b": {"des_ops.a"}}
    assert inner == {"des_ops.b": [5]}
    assert _cycle(top) == ["des_ops.a", "des_ops.b", "des_ops.a"]
    assert _cycle({"des_ops.a": {"des_ops.b"}, "des_ops.b": set()}) is None


def test_importing_the_clis_leaves_tensorflow_unstarted():
    """des.train sets TensorFlow's thread counts (--threads) after importing the job, which TensorFlow
    refuses once a tensor exists: no module may make one at import time (a class attribute did)."""
    import subprocess
    import sys
    code = ("import des.jobs.job, des.compare, des.predict, des.export, des.netbed; import tensorflow as tf; "
            "tf.config.threading.set_intra_op_parallelism_threads(1)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_modules_that_find_the_checkout_find_it():
    """des.jobs.runs, des.jobs.projection and des.cluster.netbed locate the checkout (scripts/, the
    runs' PYTHONPATH and working folder) from their own path, which the sub-packages moved."""
    from des.cluster import netbed
    from des.jobs import projection, runs
    assert runs.ROOT == projection.ROOT == netbed.ROOT == str(ROOT)
    assert os.path.exists(netbed.AGENT) and runs.launch_env()["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
