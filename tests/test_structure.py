"""The package's shape: no import cycles, modules short enough to read, light start-up."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_mlx"
MAX_LINES = 700  # a guard against a module that does everything, not a reason to split one


def _module(path: Path) -> str:
    """Dotted name of a package file relative to the package ("" for its __init__)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> package modules it imports, at any depth (function-level imports count too)."""
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: set() for m in files if m}
    for m in graph:
        path = files[m]
        package = m.split(".") if path.name == "__init__.py" else m.split(".")[:-1]
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                    names = [prefix] if node.module else [".".join(base + [a.name]) for a in node.names]
                elif (node.module or "").startswith("dflash_mlx"):
                    rest = node.module.split(".")[1:]
                    names = [".".join(rest)] if rest else [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("dflash_mlx.")]
            for name in names:
                # the deepest package module the name reaches (``from .cache import ragged`` -> cache.ragged)
                while name and name not in graph:
                    name = name.rpartition(".")[0]
                if name and name != m:
                    graph[m].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert "model" in graph and graph["costs"] >= {"model"} and graph["server.http"] >= {"server.worker"}  # really read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_modules_are_short():
    long = {_module(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_import_and_help_do_not_load_mlx():
    code = (
        "import sys, dflash_mlx\n"
        "assert 'mlx.core' not in sys.modules, 'import dflash_mlx loaded MLX'\n"
        "from dflash_mlx.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'mlx.core' not in sys.modules, '--help loaded MLX'\n"
        "from dflash_mlx import DFlashError, load\n"  # a public name pulls in the stack on first use
        "assert 'mlx.core' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_modules_looked_up_by_name_exist():
    """A module found through ``sys.modules.get("dflash_mlx...")`` (to act on it only if something
    imported it) is named by a string no import checks: a move that forgets it fails here."""
    files = {_module(p) for p in PACKAGE.rglob("*.py")}
    looked_up = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and ast.unparse(node.func.value) == "sys.modules" and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value.startswith("dflash_mlx.")):
                looked_up.append(node.args[0].value)
    assert looked_up  # the CLI's lookup of the control channel, at least
    for name in looked_up:
        assert name.removeprefix("dflash_mlx.") in files, name
