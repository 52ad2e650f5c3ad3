"""The shape of the codebase: stage packages import only earlier ones, the library never
imports configs, nothing edits sys.path, and a wheel holds what the entry points import."""

import ast
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIRST_PARTY = ("coa_jax", "configs", "tools_env")
# The order of coa_jax's packages: each may import only packages of a lower rank (and itself).
# model, losses and runtime are the foundations; data -> distill -> sft | rollout -> serving ->
# rl -> evaluation are the pipeline's stages (RL trains agent programs through the serving
# endpoint); perf tooling, the main job (pipeline) and the experiments over it come last.
RANKS = {"model": 0, "losses": 1, "runtime": 1, "train": 2, "data": 3, "distill": 4, "sft": 5,
         "rollout": 5, "serving": 6, "rl": 7, "evaluation": 8, "perf": 9, "pipeline": 10,
         "experiments": 11}


def _python_files(*folders: str) -> list[pathlib.Path]:
  return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _imports(path: pathlib.Path) -> set[str]:
  """Returns the dotted names of every module `path` imports (at any depth of the file)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def _package(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT / "coa_jax").with_suffix("").parts
  return parts[0]


def test_every_package_has_a_rank():
  packages = {_package(p) for p in _python_files("coa_jax")} - {"__init__"}
  assert packages == set(RANKS)


@pytest.mark.parametrize("path", _python_files("coa_jax"), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_from_later_stages_to_earlier_ones(path):
  own = _package(path)
  if own == "__init__":
    return
  for name in _imports(path):
    parts = name.split(".")
    assert parts[0] != "configs", f"the library imports configs: {name}"
    if parts[0] == "coa_jax" and len(parts) > 1 and parts[1] in RANKS and parts[1] != own:
      assert RANKS[parts[1]] < RANKS[own], f"{own} imports {name}, a later stage"


def test_configs_import_only_public_names():
  for path in _python_files("configs"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in ("coa_jax",
                                                                           "tools_env"):
        assert len(node.module.split(".")) <= 2, f"{path.name} imports from {node.module}"


def test_tools_env_never_imports_coa_jax():
  for path in _python_files("tools_env"):
    assert not any(n.split(".")[0] == "coa_jax" for n in _imports(path)), path


# The modules that read or build configs: the command line's reader (an entry script's --config,
# handed to its job) and the settings builders that derive one config from another; every other
# library module reads typed settings, never a ConfigDict (docs/design.md, "How settings flow").
CONFIG_BUILDERS = {"coa_jax/runtime/cli.py", "coa_jax/pipeline/job.py",
                   "coa_jax/experiments/runner.py", "coa_jax/evaluation/model_settings.py",
                   "coa_jax/evaluation/benchmarks.py"}


def test_only_the_config_builders_import_ml_collections():
  importers = {str(path.relative_to(ROOT)) for path in _python_files("coa_jax")
               if any(n.split(".")[0] == "ml_collections" for n in _imports(path))}
  assert importers == CONFIG_BUILDERS


def test_nothing_edits_sys_path():
  for path in _python_files("coa_jax", "configs", "experiments", "tests", "tools_env"):
    assert not re.search(r"sys\.path\.(insert|append)\(", path.read_text()), path


def test_a_wheel_holds_every_module_the_entry_points_and_configs_import(tmp_path):
  src = tmp_path / "src"
  for folder in FIRST_PARTY:
    shutil.copytree(ROOT / folder, src / folder,
                    ignore=shutil.ignore_patterns("__pycache__", ".bm25_cache"))
  shutil.copy(ROOT / "setup.py", src)
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
  (wheel,) = (tmp_path / "dist").glob("*.whl")
  files = set(zipfile.ZipFile(wheel).namelist())
  assert {"coa_jax/assets/coa_sample.jsonl", "tools_env/data/corpus.jsonl"} <= files
  imported = {name for path in _python_files("experiments", "configs", "coa_jax", "tools_env")
              for name in _imports(path) if name.split(".")[0] in FIRST_PARTY}
  for name in imported:
    module = name.replace(".", "/")
    package = "/".join(module.split("/")[:-1])  # `from a.b import c`: c may be a name in a.b
    assert {f"{module}.py", f"{module}/__init__.py", f"{package}.py",
            f"{package}/__init__.py"} & files, name


def _module_name(path: pathlib.Path) -> str:
  return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_no_import_circle_inside_a_package():
  """Modules of one package import each other in one direction (lazy imports count too)."""
  modules = {_module_name(p): p for p in _python_files("coa_jax") if p.name != "__init__.py"}
  edges = {}
  for name, path in modules.items():
    package = name.rsplit(".", 1)[0]
    edges[name] = {m for m in _imports(path) if m in modules and m.rsplit(".", 1)[0] == package
                   and m != name}

  def visit(name, stack):
    assert name not in stack, f"import circle: {' -> '.join(stack[stack.index(name):] + [name])}"
    for nxt in edges[name]:
      visit(nxt, stack + [name])

  for name in modules:
    visit(name, [])
