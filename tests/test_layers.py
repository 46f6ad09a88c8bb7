"""The package's shape: each layer imports only the layers below it (no cycles), sibling imports sit at the top of
files, every module opens with a docstring saying what it owns, and no module runs far past ~500 lines."""

from __future__ import annotations

import ast
import pathlib

import pytest

import fullband

ROOT = pathlib.Path(fullband.__file__).parent
# bottom to top; a module may import its own layer and the ones before it
LAYERS = ["utils", "model", "data", "eval", "training", "analysis", "serving", "commands", "cli"]
# the top-level package registers the model with transformers; the lm-eval adapter and the vLLM plugin are entry
# points loaded by other programs and import it for that registration
ROOT_IMPORT_OK = {"eval/lm_eval_adapter.py", "serving"}
LONG_OK = {"model/generation.py": "decode modes, the HF generate() hooks and the lean loop share their helpers"}


def modules():
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def layer_of(rel: pathlib.PurePosixPath) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def package_imports(path: pathlib.Path):
    """(target top-level subpackage or None for the root package, node, inside a function) for each import of
    a fullband module in ``path``."""
    rel = path.relative_to(ROOT)
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


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_layering_and_top_level_imports(path):
    rel = pathlib.PurePosixPath(path.relative_to(ROOT).as_posix())
    if rel.name == "__init__.py" and len(rel.parts) == 1:
        return  # the package root: the public API, above everything
    mine = layer_of(rel)
    assert mine in LAYERS, f"{rel}: not in a known layer"
    for target, node, inside in package_imports(path):
        where = f"{rel}:{node.lineno}"
        assert not inside, f"{where}: a package import inside a function (put it at the top of the file)"
        if target is None or target in ("__version__",):
            assert mine == "cli" or str(rel) in ROOT_IMPORT_OK or rel.parts[0] in ROOT_IMPORT_OK, \
                f"{where}: imports the root package"
            continue
        target_layer = target if target in LAYERS else None
        assert target_layer is not None, f"{where}: imports unknown module {target!r}"
        assert LAYERS.index(target_layer) <= LAYERS.index(mine), \
            f"{where}: layer {mine!r} imports the higher layer {target_layer!r}"


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


def test_the_layer_check_can_fail(tmp_path, monkeypatch):
    """The checker sees an upward import and an import inside a function."""
    bad = tmp_path / "model" / "bad.py"
    bad.parent.mkdir()
    bad.write_text('"""bad."""\nfrom ..commands import quickstart\n\n\ndef f():\n    from ..utils import io\n')
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    found = list(package_imports(bad))
    assert [(t, inside) for t, _, inside in found] == [("commands", False), ("utils", True)]
