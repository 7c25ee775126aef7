"""The package's layering: what importing a module loads, and which modules may import which."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import ntk_fl

_PACKAGE = pathlib.Path(ntk_fl.__file__).parent


def _loaded_after(statement: str) -> set[str]:
  code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return set(out.stdout.split())


def _imported_modules(relative_path: str) -> set[str]:
  """Every ``ntk_fl`` module a source file imports, at its top or inside a function."""
  tree = ast.parse((_PACKAGE / relative_path).read_text())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return {n for n in names if n.startswith("ntk_fl")}


def test_the_kernels_load_neither_flax_nor_the_device_code():
  loaded = _loaded_after("import ntk_fl.ntk")
  assert "ntk_fl.ntk" in loaded and "ntk_fl._src.kernels" in loaded
  for heavy in ("flax", "ntk_fl.models", "ntk_fl.parallel", "ntk_fl.distributed"):
    assert heavy not in loaded, heavy


def test_dense_stack_is_one_class_wherever_it_is_named():
  from ntk_fl import models, ntk, projection  # pylint: disable=import-outside-toplevel
  from ntk_fl._src.dense_stack import DenseStack  # pylint: disable=import-outside-toplevel

  assert models.DenseStack is DenseStack and ntk.DenseStack is DenseStack
  assert projection.DenseStack is DenseStack


def test_the_implementation_layer_does_not_import_the_public_kernel_module():
  # The cycle ntk -> neural_tangents_api -> ntk is gone: the private layer imports only downwards.
  public = {"ntk_fl.ntk", "ntk_fl.evolve", "ntk_fl.models"}
  for module in ("neural_tangents_api", "kernels", "options", "dense_stack"):
    assert not _imported_modules(f"_src/{module}.py") & public, module


def test_reading_a_run_directory_does_not_import_the_schema():
  # The cycle config -> rundir -> schema -> config is gone.
  assert not _imported_modules("rundir.py") & {"ntk_fl.schema", "ntk_fl.config"}
  assert "ntk_fl.schema" not in _loaded_after("import ntk_fl.rundir")


# ------------------------------------------------------------------ the layer table of docs/ARCHITECTURE.md

_ARCHITECTURE = _PACKAGE.parent / "docs" / "ARCHITECTURE.md"


def _layer_table() -> list[tuple[str, list[str]]]:
  """``[(layer name, [module patterns])]`` from the table between the ``layers`` markers, lowest first."""
  text = _ARCHITECTURE.read_text()
  table = text.split("<!-- layers: begin -->", 1)[1].split("<!-- layers: end -->", 1)[0]
  layers = []
  for row in table.strip().splitlines()[2:]:  # after the header and the rule
    name, modules = (cell.strip() for cell in row.strip().strip("|").split("|"))
    layers.append((name, [m.strip().strip("`") for m in modules.split(",")]))
  return layers


def _modules() -> dict[str, pathlib.Path]:
  """Every module of the package by dotted name (``ntk_fl.x.y``; a package by its own name)."""
  out = {}
  for path in sorted(_PACKAGE.rglob("*.py")):
    parts = list(path.relative_to(_PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    out[".".join(parts)] = path
  return out


def _import_graph(
  modules: dict[str, pathlib.Path], *, top_level_only: bool = False
) -> dict[str, set[str]]:
  """module -> the package's modules it imports anywhere in its source (top level and inside functions;
  ``top_level_only``: the imports outside function bodies, what importing the module runs)."""

  def resolve(name):  # ``ntk_fl.x.attr`` -> ``ntk_fl.x``
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name

  graph = {}
  for name, path in modules.items():
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    deps = set()
    tree = ast.parse(path.read_text())
    skipped = set()
    if top_level_only:
      for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
          skipped.update(id(n) for n in ast.walk(fn) if n is not fn)
    for node in ast.walk(tree):
      if id(node) in skipped:
        continue
      if isinstance(node, ast.Import):
        deps.update(resolve(a.name) for a in node.names if a.name.split(".")[0] == "ntk_fl")
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        if base.split(".")[0] != "ntk_fl":
          continue
        for alias in node.names:  # ``from ntk_fl import rundir`` names a module
          full = f"{base}.{alias.name}"
          deps.add(full if full in modules else resolve(base))
    graph[name] = deps - {name, ""}
  return graph


def _layer_of(modules) -> dict[str, int]:
  """Each module's layer index (0 = lowest) by the table: an exact name before a ``package.*`` pattern."""
  exact, wildcard = {}, {}
  for index, (_, patterns) in enumerate(_layer_table()):
    for pattern in patterns:
      full = "ntk_fl" if pattern == "ntk_fl" else f"ntk_fl.{pattern}"
      target = wildcard if full.endswith(".*") else exact
      assert full.removesuffix(".*") not in target, f"{pattern} is listed twice"
      target[full.removesuffix(".*")] = index
  layers = {}
  for module in modules:
    if module in exact:
      layers[module] = exact[module]
      continue
    parents = [p for p in wildcard if module.startswith(p + ".")]
    if parents:
      layers[module] = wildcard[max(parents, key=len)]
  return layers


def _longest_chains(graph) -> dict[str, list[str]]:
  """module -> its longest chain of imports (itself first), in an acyclic ``graph``."""
  best: dict[str, list[str]] = {}

  def chain(module):
    if module not in best:
      best[module] = [module] + max((chain(d) for d in graph[module]), key=len, default=[])
    return best[module]

  for module in graph:
    chain(module)
  return best


def test_the_layer_table_lists_every_module_and_only_existing_ones():
  modules = _modules()
  layers = _layer_of(modules)
  unlisted = sorted(set(modules) - set(layers))
  assert not unlisted, f"modules missing from the layer table of docs/ARCHITECTURE.md: {unlisted}"
  for _, patterns in _layer_table():
    for pattern in patterns:
      full = "ntk_fl" if pattern == "ntk_fl" else f"ntk_fl.{pattern}"
      assert full.removesuffix(".*") in modules, (
        f"the layer table names {pattern}, which does not exist"
      )


def test_imports_go_only_downwards_by_the_layer_table():
  modules = _modules()
  graph, layers = _import_graph(modules), _layer_of(modules)
  names = [name for name, _ in _layer_table()]
  upward = sorted(
    f"{m} (layer {names[layers[m]]!r}) imports {d} (layer {names[layers[d]]!r})"
    for m, deps in graph.items()
    for d in deps
    if layers[d] > layers[m]
  )
  assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle():
  graph = _import_graph(_modules())
  state: dict[str, int] = {}  # 1 = on the current path, 2 = done

  def visit(module, path):
    state[module] = 1
    for dep in sorted(graph[module]):
      if state.get(dep) == 1:
        raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep) :] + [dep]))
      if dep not in state:
        visit(dep, path + [dep])
    state[module] = 2

  for module in sorted(graph):
    if module not in state:
      visit(module, [module])


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
  # The graph builder itself, on a made-up package: a cycle through a function-level import is found.
  pkg = tmp_path / "ntk_fl"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "low.py").write_text("def f():\n  from ntk_fl import high\n")
  (pkg / "high.py").write_text("import ntk_fl.low\n")
  (pkg / "sub" / "__init__.py").write_text("from . import leaf\nfrom ..low import f\n")
  (pkg / "sub" / "leaf.py").write_text("from ntk_fl.sub.leaf import nothing  # itself\n")
  modules = {}
  for path in sorted(pkg.rglob("*.py")):
    parts = list(path.relative_to(tmp_path).with_suffix("").parts)
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  graph = _import_graph(modules)
  assert graph["ntk_fl.low"] == {"ntk_fl.high"} and graph["ntk_fl.high"] == {"ntk_fl.low"}
  assert (
    graph["ntk_fl.sub"] == {"ntk_fl.sub.leaf", "ntk_fl.low"} and graph["ntk_fl.sub.leaf"] == set()
  )
  top = _import_graph(modules, top_level_only=True)
  assert top["ntk_fl.low"] == set() and top["ntk_fl.high"] == {"ntk_fl.low"}


def test_the_import_chains_stay_short():
  # Counted in modules, function-level imports included: the whole package (from the commands at the
  # top, through a run, to the leaves), and the kernel stack and the NTK step.
  graph = _import_graph(_modules())
  chains = _longest_chains(graph)
  # The names a config is checked against (datasets, partitions, models, activations, the shipped
  # maps) and the mesh axis live in the leaf ``_src.names``, and the method registry in the method
  # interface ``algorithms.base`` (two levels): the config layer loads in two levels, the schema and
  # the run directory in three, and a run (``__main__`` -> ``cli`` -> ``runner``) in six. The
  # experiment registry needs only the configs. The cost estimate imports no kernel code (the method
  # hands it its NTK step), the kernels import only leaves, and the package's own modules import
  # ``_src`` directly, never the ``evolve`` face. What several methods reuse sits in the rounds they
  # share (``server_round``: CP-NTK-FL's participant inputs for FedAvg', QSGD's uplink for FedCOM;
  # ``neighbourhood_round``: NTK-DFL's round for SPARK), and the sketch takes ``ParamMap`` from a leaf
  # and its kernel pieces from ``_src.projected_kernel``, so no method module imports another.
  for top, most in (
    ("ntk_fl.__main__", 6),
    ("ntk_fl.reproduce", 6),
    ("ntk_fl.cli", 5),
    ("ntk_fl.runner", 4),
    ("ntk_fl.schema", 3),
    ("ntk_fl.rundir", 3),
    ("ntk_fl.compare", 4),
    ("ntk_fl.metrics", 3),
    ("ntk_fl.distributed", 2),
    ("ntk_fl.algorithms.spark", 5),
    ("ntk_fl.algorithms.fedavg", 5),
    ("ntk_fl.algorithms.fedcom", 5),
    ("ntk_fl.algorithms.ntk_dfl", 5),
    ("ntk_fl.algorithms.server_round", 4),
    ("ntk_fl.algorithms.neighbourhood_round", 4),
    ("ntk_fl.algorithms.base", 2),
    ("ntk_fl.algorithms", 3),
    ("ntk_fl.projection", 4),
    ("ntk_fl.reproduce.experiments", 4),
    ("ntk_fl.config", 2),
    ("ntk_fl.topology", 2),
    ("ntk_fl.evolve", 5),
    ("ntk_fl._src.ntk_step", 4),
    ("ntk_fl.ntk", 4),
    ("ntk_fl._src.projected_kernel", 3),
    ("ntk_fl._src.kernels", 2),
    ("ntk_fl._src.param_map", 1),
    ("ntk_fl._src.cost", 1),
  ):
    assert len(chains[top]) <= most, " -> ".join(chains[top])
  # Six levels only for two commands, each level needed (docs/ARCHITECTURE.md): ``python -m ntk_fl``
  # (``__main__`` -> ``cli`` -> ``runner`` -> ``metrics`` -> ``parallel`` -> ``_src.names``; the
  # console script starts at ``cli``) and ``ntk-fl reproduce`` (``reproduce`` -> ``reproduce.render``
  # -> ``compare`` -> ``rundir`` -> ``algorithms.base`` -> ``_src.options``). Every other module: five.
  commands = {"ntk_fl.__main__", "ntk_fl.reproduce"}
  longest = max((c for m, c in chains.items() if m not in commands), key=len)
  assert len(longest) <= 5, " -> ".join(longest)
  # What importing a module runs (its top-level imports only): five at most, the method modules on the
  # rounds they share or on the NTK step (``_src.ntk_step`` -> ``_src.evolution`` -> ``_src.kernels``).
  loaded = _longest_chains(_import_graph(_modules(), top_level_only=True))
  longest = max(loaded.values(), key=len)
  assert len(longest) <= 5, " -> ".join(longest)


def test_the_leaf_names_are_the_implementations_names():
  # ``_src.names`` holds the config's choices apart from the code that implements them; the modules
  # that implement them re-export the same objects, and the activation table has exactly those names.
  from ntk_fl import models, parallel  # pylint: disable=import-outside-toplevel
  from ntk_fl._src import names  # pylint: disable=import-outside-toplevel
  from ntk_fl.data import index_map, sources  # pylint: disable=import-outside-toplevel
  from ntk_fl.data.partition import PARTITIONS  # pylint: disable=import-outside-toplevel

  assert tuple(models._ACTIVATIONS) == names.ACTIVATIONS  # pylint: disable=protected-access
  assert models.ACTIVATIONS is names.ACTIVATIONS and models.MODELS is names.MODELS
  assert sources.DATASETS is names.DATASETS and PARTITIONS is names.PARTITIONS
  assert index_map.VENDORED_MAPS is names.VENDORED_MAPS and parallel.CLIENTS == "clients"
  assert index_map.authors_map_name is names.authors_map_name


def test_checking_a_config_loads_neither_the_models_nor_the_data_code():
  loaded = _loaded_after("import ntk_fl.schema")
  for heavy in ("flax", "ntk_fl.models", "ntk_fl.data", "ntk_fl.parallel", "ntk_fl.topology"):
    assert heavy not in loaded, heavy


def test_the_kernels_and_the_cost_estimate_import_only_leaves():
  graph = _import_graph(_modules())
  leaves = {m for m, deps in graph.items() if not deps}
  assert graph["ntk_fl._src.kernels"] <= leaves, sorted(graph["ntk_fl._src.kernels"] - leaves)
  assert not graph["ntk_fl._src.cost"], sorted(graph["ntk_fl._src.cost"])
  # ``evolve`` only re-exports ``_src``: a module of the package importing it adds a level for nothing.
  importers = sorted(m for m, deps in graph.items() if "ntk_fl.evolve" in deps and m != "ntk_fl")
  assert not importers, importers


def test_the_method_interface_loads_no_graph_nor_evaluation_code():
  loaded = _loaded_after("import ntk_fl.algorithms.base")
  for heavy in ("ntk_fl.topology", "ntk_fl.gossip", "ntk_fl.metrics", "ntk_fl.parallel", "flax"):
    assert heavy not in loaded, heavy


def test_the_implementation_layer_imports_no_public_face():
  # ``ntk`` and ``evolve`` re-export ``_src``; a ``_src`` module importing them would add their whole
  # chain to its own (and close a cycle as soon as they re-export that module).
  graph = _import_graph(_modules())
  faces = {"ntk_fl.ntk", "ntk_fl.evolve"}
  offenders = {m: sorted(d & faces) for m, d in graph.items() if m.startswith("ntk_fl._src")}
  assert not {m: d for m, d in offenders.items() if d}, offenders
  # The method interface checks an NTK method's settings with the option leaf, not the NTK step's face.
  assert not graph["ntk_fl.algorithms.base"] & faces


def test_the_chain_finder_finds_the_longest_chain():
  # On a made-up graph: a -> b -> d -> e and a -> c -> e; the longest from a is four modules long.
  graph = {"a": {"b", "c"}, "b": {"d"}, "c": {"e"}, "d": {"e"}, "e": set()}
  assert _longest_chains(graph)["a"] == ["a", "b", "d", "e"]
  assert _longest_chains(graph)["c"] == ["c", "e"]
