"""The layers' import rules: the core (cache, decoder, generate, its options, filters and steps, in-flight batching)
imports no other part of xattn; fast/ and hf/ build on the core only; tasks/ never reach train/ or bench/. Read from
the source (ast), so a lazy import inside a function counts too."""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "xattn")
CORE = ("xattn.cache", "xattn.decoder", "xattn.generate", "xattn.generation_options", "xattn.inflight",
        "xattn.logit_filters", "xattn.logprobs", "xattn.steps")
RULES = {  # layer -> what it may import from xattn (besides itself)
    "core": set(CORE),
    "fast": set(CORE),
    "hf": set(CORE) | {"xattn.fast"},
    "tasks": set(CORE) | {"xattn.fast", "xattn.hf", "xattn.files", "xattn.jobs", "xattn.datasets"},
    "integrations": set(CORE) | {"xattn.tasks"},  # other projects' pipelines (coqui-tts, tortoise) over tasks/
}


def _modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = "xattn." + os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                yield module.removesuffix(".__init__"), path


def _imports(module: str, path: str) -> set[str]:
    """Every xattn module this file imports, resolved from relative form."""
    with open(path) as f:
        tree = ast.parse(f.read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("xattn")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.startswith("xattn"):
                found |= {f"{source}.{alias.name}" for alias in node.names} if node.module is None else {source}
    return found


def _layer(module: str) -> str | None:
    if module in CORE:
        return "core"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in RULES else None


def _allowed(target: str, allowed: set[str], own: str) -> bool:
    return any(target == a or target.startswith(a + ".") for a in allowed | {own})


@pytest.mark.parametrize("module,path", sorted(m for m in _modules() if _layer(m[0])))
def test_each_layer_imports_only_what_it_may(module, path):
    layer = _layer(module)
    own = module if layer == "core" else f"xattn.{layer}"
    bad = sorted(t for t in _imports(module, path) if t != "xattn" and not _allowed(t, RULES[layer], own))
    assert not bad, f"{module} ({layer}) imports {bad}"


def test_the_decode_path_is_three_short_files():
    for name in ("cache", "decoder", "generate"):
        with open(os.path.join(PACKAGE, f"{name}.py")) as f:
            assert len(f.readlines()) < 350, name


def test_the_rules_catch_a_forbidden_import(tmp_path):
    path = tmp_path / "decoder.py"
    path.write_text("def f():\n    from .fast import accelerate\n")
    imported = _imports("xattn.decoder", str(path))
    assert imported == {"xattn.fast"} and not _allowed("xattn.fast", RULES["core"], "xattn.decoder")
