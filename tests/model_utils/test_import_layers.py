"""The packages import one way: each imports only from its own layer or the layers below it
(LAYERS), there is no circle among them, the engine never imports gradio, and the swapped-in
layers import neither loading nor runtime.

Read from the source (ast), not by importing. Every import counts, also one deferred into a
function (it runs as soon as that function does); only those under TYPE_CHECKING do not."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("model_utils", "server", "ui")
# Bottom to top. A package may import from its own layer and from any layer below it.
LAYERS = (
    ("model_utils.errors", "model_utils.memory"),           # no torch, no project imports
    ("model_utils.layers", "model_utils.training"),          # swapped-in layers; the training loop
    ("model_utils.loading",),                                # weights, tokenizer, mode, device map
    ("model_utils.engine_config",),                          # the options (reads the modes table)
    ("model_utils.runtime",),                                # serving: scheduler, runner, KV cache
    ("model_utils.chat",),                                   # messages -> prompt, replies as text
    ("model_utils.engine", "model_utils.process_tuning", "model_utils.completion"),
    ("model_utils.engine_factory", "model_utils.parallel", "model_utils.backends",
     "model_utils.bench", "model_utils.finetune", "model_utils.cli_args", "model_utils.cli",
     "model_utils.__main__", "model_utils"),
    ("server",),
    ("ui",),
)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules `name` imports, at its top or inside its functions."""
    tree = ast.parse(path.read_text())
    type_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    targets = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            # `from pkg import sub` imports the submodule; `from mod import name`, the module
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                     for alias in node.names]
        else:
            continue
        for target in names:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
    return targets


def package_of(module: str) -> str:
    """model_utils.loading.manager -> model_utils.loading; model_utils.engine -> itself;
    server.api -> server."""
    return ".".join(module.split(".")[:2]) if module.startswith("model_utils") else \
        module.split(".")[0]


def layer_of(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def package_graph() -> dict[str, dict[str, set[str]]]:
    """package -> package it imports -> the modules that do."""
    known = modules()
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, path in known.items():
        for target in imports(name, path, known):
            if package_of(target) != package_of(name):
                graph[package_of(name)][package_of(target)].add(name)
    return graph


def circles(graph) -> list[list[str]]:
    """Each import circle as the packages on it (depth-first search for back edges)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in graph.get(node, {}):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in list(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_every_package_has_a_layer_and_imports_only_downwards():
    graph = package_graph()
    packages = {package_of(name) for name in modules()}
    assert sorted(p for p in packages if not any(p in layer for layer in LAYERS)) == []
    upwards = [f"{a} -> {b} by {sorted(graph[a][b])}" for a in graph for b in graph[a]
               if layer_of(b) > layer_of(a)]
    assert upwards == []


def test_no_import_circle_among_the_packages():
    graph = package_graph()
    described = [" -> ".join(c) + "  (" + "; ".join(
        f"{a} -> {b} by {sorted(graph[a][b])}" for a, b in zip(c, c[1:])) + ")"
        for c in circles(graph)]
    assert described == []


def test_the_engine_never_imports_gradio_and_the_layers_stay_below_loading():
    known = modules()
    for name, path in known.items():
        if not name.startswith("model_utils"):
            continue
        every = {alias.name.split(".")[0] for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Import) for alias in node.names}
        every |= {node.module.split(".")[0] for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        assert "gradio" not in every, name
    layers = {target for name, path in known.items() if name.startswith("model_utils.layers")
              for target in imports(name, path, known)}
    assert not {package_of(t) for t in layers} & {"model_utils.loading", "model_utils.runtime"}


def test_a_circle_would_be_found():
    assert circles({"a": {"b": set()}, "b": {"c": set()}, "c": {"a": set()}}) == [
        ["a", "b", "c", "a"]]
    assert circles({"a": {"b": set()}, "b": {}}) == []


def test_the_remote_backend_engine_imports_no_torch():
    """The engine in front of a model server loads no model: importing it leaves torch out."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", (
        "import sys; import model_utils.backends.remote, model_utils.backends.flags, "
        "model_utils.memory; sys.exit(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'transformers')) or 0)")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
