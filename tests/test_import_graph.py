"""The package's modules import each other without a circle, counting imports inside functions too (one there
only hides the circle until the function runs). JAX-free: the graph is read from the source."""

import ast
import pathlib

from conftest import ROOT


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str = "tiderl_jax") -> dict[str, set[str]]:
    """{module: the package's modules it imports}, from every import statement in its source."""
    files = {_module(p): p for p in (ROOT / package).rglob("*.py")}
    graph = {m: set() for m in files}
    for m, path in files.items():
        here = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for name in names:
                if name in files and name != m:
                    graph[m].add(name)
                    break  # `from a.b import c`: the module c, else a.b
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_reader_finds_a_circle_hidden_in_a_function():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_through_others():
    graph = import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 200  # the whole package read
    assert circles(graph) == []


# The layers from the bottom (docs/architecture.md): a module imports only from its own layer or below. Leaves of
# the package's top level sit where their imports put them: `trajectory.py` (the record rollouts, the HTTP front
# and the trainer share) just above the model it reads image spans from.
LAYERS = ({"policies", "import_path", "interrupts", "progress"}, {"model"}, {"trajectory"}, {"engine"},
          {"serving"}, {"agents"}, {"data"}, {"rl"}, {"faults"})


def _layer(module: str) -> int | None:
    name = module.split(".")[1] if "." in module else module
    return next((i for i, names in enumerate(LAYERS) if name in names), None)


def test_imports_point_down_the_layers():
    """The serving layer imports neither agents/ nor data/ (external agents are a rollout source: agents/); the
    rollout loop reaches the reward-failure type in agents/env.py, below data/rewards.py which raises it."""
    graph = import_graph()
    against = sorted((m, d) for m, deps in graph.items() for d in deps
                     if _layer(m) is not None and _layer(d) is not None and _layer(d) > _layer(m))
    assert against == []
    assert _layer("tiderl_jax.serving.openai_api.frontend") < _layer("tiderl_jax.agents.external")
    assert {_layer(f"tiderl_jax.{p}") for p in ("policies", "model", "engine", "serving", "agents", "data", "rl",
                                                   "faults")} == set(range(len(LAYERS))) - {2}
