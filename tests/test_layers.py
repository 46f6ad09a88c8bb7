"""The package's shape: each layer imports only the layers below it (no cycles), sibling imports sit at the top of
files, every module opens with a docstring saying what it owns, and no module runs far past ~500 lines."""

from __future__ import annotations

import ast
import pathlib

import pytest

import fullband

ROOT = pathlib.Path(fullband.__file__).parent
# bottom to top; a module may import its own layer and the ones before it. The table (what each layer owns):
#   utils        errors, atomic I/O, statistics, plotting helpers
#   model        the full-bandwidth model: configuration, K-pass forward, generation
#   data         tokenizers, corpora, row order
#   eval         scoring per decode mode, FLOPs, the synthetic tasks, the lm-eval adapter
#   training     config, engine, checkpoints, distributed, the pretraining / SFT recipes
#   analysis     analyses of trained models and runs (probes, reports)
#   serving      the serving integrations (vLLM plugin, lm-eval adapter) and their commands
#   experiments  what `fullband quickstart` and each `fullband experiment X` trains, measures and reports
#   commands     the command line: options, defaults, help texts, a call into the layer below
#   cli          the `fullband` entry point
LAYERS = ["utils", "model", "data", "eval", "training", "analysis", "serving", "experiments", "commands", "cli"]
# imports a layer may not make although the order allows them: experiments stand on training and analysis, not on
# the serving integrations
NOT_FROM = {"experiments": {"serving"}}
# the top-level package registers the model with transformers; the lm-eval adapter and the vLLM plugin are entry
# points loaded by other programs and import it for that registration
ROOT_IMPORT_OK = {"eval/lm_eval_adapter.py", "serving"}
LONG_OK = {"model/generation.py": "decode modes, the HF generate() hooks and the lean loop share their helpers",
           "model/modeling.py": "the model class: its checks, the K-pass forward (with its long-recurrence, loss and "
                                "exact-states options) and the exact recurrence, each written once",
           "training/engine.py": "the Trainer of small steps (setup, step, after_step, finish) with the guard's stop "
                                 "and its last-good-step checkpoint, which read and write the Trainer's own state"}


def modules():
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def layer_of(rel: pathlib.PurePosixPath) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def package_imports(path: pathlib.Path, root: pathlib.Path = ROOT):
    """(target top-level subpackage or None for the root package, node, inside a function) for each import of
    a fullband module in ``path`` (a file under ``root``)."""
    rel = path.relative_to(root)
    pkg = list(rel.parts[:-1])
    tree = ast.parse(path.read_text())
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def in_function(node):
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return True
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                parts = base + (node.module.split(".") if node.module else [])
                if not parts:  # "from . import x" in the root package
                    parts = [node.names[0].name]
            elif node.module and node.module.split(".")[0] == "fullband":
                parts = node.module.split(".")[1:] or [None]
            else:
                continue
            yield (parts[0] if parts else None), node, in_function(node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fullband":
                    parts = alias.name.split(".")[1:]
                    yield (parts[0] if parts else None), node, in_function(node)


def layer_violations(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """What is wrong with ``path``'s imports: a package import inside a function, an import of the root package
    (outside the allowed entry points), of an unknown module, or of a higher layer."""
    rel = pathlib.PurePosixPath(path.relative_to(root).as_posix())
    if rel.name == "__init__.py" and len(rel.parts) == 1:
        return []  # the package root: the public API, above everything
    mine = layer_of(rel)
    if mine not in LAYERS:
        return [f"{rel}: not in a known layer"]
    found = []
    for target, node, inside in package_imports(path, root):
        where = f"{rel}:{node.lineno}"
        if inside:
            found.append(f"{where}: a package import inside a function (put it at the top of the file)")
        if target is None or target in ("__version__",):
            if not (mine == "cli" or str(rel) in ROOT_IMPORT_OK or rel.parts[0] in ROOT_IMPORT_OK):
                found.append(f"{where}: imports the root package")
        elif target not in LAYERS:
            found.append(f"{where}: imports unknown module {target!r}")
        elif LAYERS.index(target) > LAYERS.index(mine):
            found.append(f"{where}: layer {mine!r} imports the higher layer {target!r}")
        elif target in NOT_FROM.get(mine, ()):
            found.append(f"{where}: layer {mine!r} may not import {target!r}")
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_layering_and_top_level_imports(path):
    assert layer_violations(path) == []


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_says_what_it_owns_and_stays_readable(path):
    rel = path.relative_to(ROOT).as_posix()
    text = path.read_text()
    if path.name == "__init__.py" and not text.strip():
        return
    doc = ast.get_docstring(ast.parse(text))
    assert doc and len(doc) > 20, f"{rel}: no opening docstring"
    lines = len(text.splitlines())
    assert lines <= 500 or rel in LONG_OK, f"{rel}: {lines} lines; split it or state the reason in LONG_OK"
    assert lines <= 600, f"{rel}: {lines} lines"


def test_the_layer_check_can_fail(tmp_path):
    """The check itself (not only the import scanner) rejects each kind of violation in a module written to break
    it, names the line, and passes the same module once it is fixed. Bugs it catches: a comparison of layer
    indices the wrong way round, relative imports resolved from the wrong package, a violation skipped because an
    earlier one on the file was already found."""
    (tmp_path / "model").mkdir()
    (tmp_path / "commands").mkdir()
    bad = tmp_path / "model" / "bad.py"
    bad.write_text('"""bad."""\nfrom ..commands import quickstart\nimport fullband.training.engine\n'
                   'from fullband import cli\nfrom .. import nowhere\n\n\ndef f():\n    from ..utils import io\n')
    assert layer_violations(bad, tmp_path) == [
        "model/bad.py:2: layer 'model' imports the higher layer 'commands'",
        "model/bad.py:3: layer 'model' imports the higher layer 'training'",
        "model/bad.py:4: imports the root package",  # `from fullband import cli` reaches cli through the root
        "model/bad.py:5: imports unknown module 'nowhere'",
        "model/bad.py:9: a package import inside a function (put it at the top of the file)",
    ]
    good = tmp_path / "commands" / "good.py"  # downward imports are fine, relative or absolute
    good.write_text('"""good."""\nfrom ..model import modeling\nfrom ..training.engine import run\n'
                    'import fullband.utils.io\nfrom . import bad\n')
    assert layer_violations(good, tmp_path) == []
    root_import = tmp_path / "data" / "x.py"
    root_import.parent.mkdir()
    root_import.write_text('"""x."""\nimport fullband\n')
    assert layer_violations(root_import, tmp_path) == ["data/x.py:2: imports the root package"]
    (tmp_path / "experiments").mkdir()
    experiment = tmp_path / "experiments" / "e.py"  # between training/analysis and commands, never on serving
    experiment.write_text('"""e."""\nfrom ..training import engine\nfrom ..analysis import x\nfrom . import common\n'
                          'from ..commands import quickstart\nfrom ..serving import plugin\n')
    assert layer_violations(experiment, tmp_path) == [
        "experiments/e.py:5: layer 'experiments' imports the higher layer 'commands'",
        "experiments/e.py:6: layer 'experiments' may not import 'serving'",
    ]
    good.write_text('"""good."""\nfrom ..experiments import recipe\n')
    assert layer_violations(good, tmp_path) == []


def test_the_readme_layout_names_every_module():
    """The README's Layout table lists each layer's modules: a module added without its row entry fails here (it
    drifted twice). Reads the table's ``modules`` cell of each layer's row."""
    readme = (ROOT.parent.parent / "README.md").read_text()
    rows = {line.split("|")[1].strip().strip("`").rstrip("/"): line.split("|")[2]
            for line in readme.splitlines() if line.startswith("| `") and line.count("|") >= 4}
    missing = []
    for layer in LAYERS[:-1]:
        assert layer in rows, f"README Layout: no row for {layer}/"
        for p in sorted((ROOT / layer).glob("*.py")):
            if p.name != "__init__.py" and f"`{p.stem}`" not in rows[layer]:
                missing.append(f"{layer}/{p.name}")
    assert missing == [], f"README Layout table does not name: {missing}"
