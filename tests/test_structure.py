"""The code's shape, as docs/structures.md states it: each floor imports only from the floors
below it (kernels < worker < cluster < router < pagefleet; events go up through injected
sinks), nothing imports tests or benchmarks, and a router process loads no torch: what crosses
a group's boundary (worker/protocol.py, worker/outputs.py, the hashing) is free of it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"kernels": 1, "worker": 2, "cluster": 3, "router": 4, "pagefleet": 5}
STRUCTURES = ROOT / "docs" / "structures.md"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_a_floor_imports_only_from_below(package):
    floor = FLOORS[package]
    upward = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, module in imports(path)
        if FLOORS.get(top := module.split(".")[0], 0) > floor or top in ("tests", "benchmarks")
    ]
    assert upward == []


# Inside worker/: the engine drives the executors, which run the model, which calls kernels.
# The modules at worker/'s top (the step hand-off, protocol, configuration) sit below all three.
WINGS = {"model": 1, "exec": 2, "engine": 3}
# the one import up from worker/'s top: naming the built-in model builds it on first use (a
# function-scope import, so that resolving any other name loads no torch)
BUILDS_ON_FIRST_USE = {("worker/model_source.py", "worker.model.builtin_model")}


def test_worker_wings_import_in_one_direction():
    """engine > exec > model inside worker/: a wing imports only from the wings below it and
    from worker/'s top-level modules, which import no wing."""
    upward = []
    for path in sorted((ROOT / "worker").rglob("*.py")):
        parts = path.relative_to(ROOT / "worker").parts
        rank = WINGS.get(parts[0], 0) if len(parts) > 1 else 0
        for line, module in imports(path):
            names = module.split(".")
            where = str(path.relative_to(ROOT))
            if names[0] == "worker" and len(names) > 2 and WINGS.get(names[1], 0) > rank:
                if (where, module) in BUILDS_ON_FIRST_USE:
                    continue
                upward.append(f"{where}:{line} imports {module}")
    assert upward == []


def test_the_router_loads_no_torch():
    """What `pagefleet serve --role router` imports (the router, its policies, both doors,
    the Ray groups' directory, the client) leaves torch, triton and transformers' models
    unloaded."""
    code = (
        "import sys\n"
        "import pagefleet.cli, pagefleet.client, router.launch.run, router.router, router.placement\n"
        "import router.door.server, router.door.http, router.ray_groups, cluster.ray.directory\n"
        "import worker.protocol, worker.config\n"
        "loaded = sorted(m for m in ('torch', 'triton', 'kernels') if m in sys.modules)\n"
        "print(loaded)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_docs_structures_lists_every_module_and_only_existing_paths():
    """docs/structures.md has one line per module of the floors and protos/ (generated modules
    aside), and every path it names exists, so the map cannot drift from the code."""
    text = STRUCTURES.read_text()
    listed = re.findall(r"^- `([\w/]+\.py)`:", text, flags=re.MULTILINE)
    modules = sorted(
        str(path.relative_to(ROOT))
        for top in [*FLOORS, "protos"]
        for path in (ROOT / top).rglob("*.py")
        if "_pb2" not in path.name
    )
    assert sorted(listed) == modules
    named = set(re.findall(r"`((?:[\w.-]+/)+[\w.-]*)`", text))
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


@pytest.mark.parametrize("model", ["builtin", "default"])
def test_a_routers_tokenizer_from_the_groups_files_is_the_groups(model):
    """A router of a cluster tokenizes with the tokenizer rebuilt from a group's files
    (worker/protocol.py: ModelFacts), without transformers' model classes: the same ids for
    text and for a chat, as the group's own tokenizer (the built-in model's and the default
    GGUF model's, whose tokenizer transformers converts from the file's metadata)."""
    from worker.engine.llm_engine import load_tokenizer
    from worker.model_source import resolve_model
    from worker.protocol import ModelFacts

    group = load_tokenizer(resolve_model(model))
    router = ModelFacts(None, 0, 0, (), ModelFacts.tokenizer_files_of(group)).tokenizer()
    texts = ["Hello world", "  spaces, émojis 🎉 and\nnew lines ", "<|im_start|>user", "3.14"]
    assert [router.encode(t) for t in texts] == [group.encode(t) for t in texts]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    render = lambda tok: tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)  # noqa: E731
    assert render(router) == render(group)
    assert router.decode(group.encode(texts[1])) == group.decode(group.encode(texts[1]))
