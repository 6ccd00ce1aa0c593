"""The package's imports follow the request path: no import circles, and every import goes down the layer order.

The graph is read with `ast` from the source of every module under tokenmill/ (nothing is imported, so this runs in
well under a second). It counts every import statement: module level, inside functions and under TYPE_CHECKING
alike, because an import deferred into a function is still a dependency of that module. An edge goes to the
module named (`from tokenmill.a import b` names tokenmill.a.b when that is a module, tokenmill.a otherwise). Names
imported by string (importlib: the model registry's lazy classes, the `tokenmill bench` table) are not seen; those
tables are how the lower layers stay free of what they name.

LAYERS below is the order, lowest first. A module may import modules of its own layer or of any lower one; an
import of a higher layer is an upward import and must be one of ALLOWED_UPWARD, each with its reason, and a
comment saying why at the import itself. Imports within a layer may go either way, but never round in a circle.
"""
from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tokenmill"
ROOT = "tokenmill"

# (layer, the modules and packages it holds, what it is and why it sits there). A package entry holds its
# submodules; the root package (tokenmill/__init__.py) holds only itself.
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    ("base", ("tokenmill.envs", "tokenmill.logger", "tokenmill.gc_utils", "tokenmill.inputs", "tokenmill.outputs"),
     "environment variables, logging, GC, the prompt and output types the user sees"),
    ("distributed", ("tokenmill.distributed",),
     "process groups, collectives, sharding arithmetic: a library over torch.distributed that reads no config "
     "(config/parallel.py checks TP divisibility with its arithmetic)"),
    ("transformers_utils", ("tokenmill.transformers_utils",),
     "HF configs, tokenizers, GGUF metadata, model resolution; below config, which resolves the model through it"),
    ("config", ("tokenmill.config",), "one dataclass per concern, validated; the CLI built from them"),
    ("structured", ("tokenmill.structured",),
     "structured-output params, grammar compilation and bitmask filling, all on the host (the worker applies "
     "the masks)"),
    ("sampling_params", ("tokenmill.sampling_params",), "SamplingParams, which holds a StructuredOutputsParams"),
    ("lora_request", ("tokenmill.lora.request",),
     "LoRARequest, which the engine's messages carry (msgspec only; the rest of tokenmill.lora sits above layers)"),
    ("core", ("tokenmill.core",),
     "CPU-only scheduling: requests, KV blocks, the scheduler, and the messages in and out of the engine core "
     "(the lowest layer that builds them)"),
    ("metrics", ("tokenmill.metrics",), "stats from core's messages, Prometheus metrics, step timers"),
    ("kernels", ("tokenmill.kernels",),
     "Triton kernels with their launch helpers, tuning data and the number formats they share (fp8 KV, the "
     "sampling RNG); above core, which never launches device work"),
    ("attention", ("tokenmill.attention", "tokenmill.forward_context"),
     "attention backends and layer; the per-step forward context carries their metadata"),
    ("layers", ("tokenmill.layers",), "linear (with quantization methods), norm, rotary, embedding, sampler"),
    ("lora", ("tokenmill.lora",), "PEFT adapter loading, adapter slots, the deltas hooked into the linear layers"),
    ("models", ("tokenmill.models",), "model families, registry, weight loading"),
    ("spec_decode", ("tokenmill.spec_decode",),
     "drafters (n-gram, suffix, a draft model it loads) the runner asks for draft tokens"),
    ("worker", ("tokenmill.worker",), "one device's model runner, CUDA graphs, step inputs, the PP result path"),
    ("executor", ("tokenmill.executor",), "runs the workers: one process, several, or Ray"),
    ("engine", ("tokenmill.engine",), "engine core, its process and client, LLMEngine, AsyncLLM, processors"),
    ("parsers", ("tokenmill.parsers",), "tool-call and reasoning parsers, used by the front ends above"),
    ("beam_search", ("tokenmill.beam_search",), "beam search over an engine's generate, for LLM and the server"),
    ("entrypoints", ("tokenmill.entrypoints", ROOT),
     "LLM, the OpenAI server, the CLI; the root package re-exports LLM and the engines lazily"),
    ("benchmarks", ("tokenmill.benchmarks",), "tokenmill bench ..."),
]

# (importer, imported) -> why this import goes up. At most 3; the import line carries a comment that says why.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("tokenmill.config.model", "tokenmill.models.registry"):
        "A GGUF-derived HF config names only a model_type; ModelConfig takes its architecture from the model "
        "registry's model_type table. The registry is a name table that imports model code only lazily (importlib), "
        "so the import pulls in nothing, and keeping every family's names in that one table keeps a new family one "
        "registry line (vLLM's ModelConfig consults its registry the same way).",
}
MAX_UPWARD = 3


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, dict[str, int]]:
    """importer -> {imported module: first line}, tokenmill modules only, self-imports dropped."""
    graph: dict[str, dict[str, int]] = defaultdict(dict)
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].setdefault(name, node.lineno)
    return graph


def _layer_of(mods) -> dict[str, int]:
    rank = {}
    for mod in mods:
        best = None
        for i, (_, entries, _) in enumerate(LAYERS):
            for entry in entries:
                if mod == entry or (entry != ROOT and mod.startswith(entry + ".")):
                    if best is None or len(entry) > best[1]:
                        best = (i, len(entry))
        if best is not None:
            rank[mod] = best[0]
    return rank


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


MODS = _modules()
GRAPH = _imports(MODS)
RANK = _layer_of(MODS)


def _where(importer: str, imported: str) -> str:
    return f"{MODS[importer].relative_to(PACKAGE.parent)}:{GRAPH[importer][imported]}"


def test_every_module_has_a_layer():
    missing = sorted(set(MODS) - set(RANK))
    assert not missing, f"modules in no layer (add them to LAYERS in {__file__}): {missing}"


def test_no_import_circles():
    problems = []
    for comp in _cycles(GRAPH):
        members = set(comp)
        edges = [f"{a} -> {b} ({_where(a, b)})" for a in comp for b in sorted(GRAPH[a]) if b in members]
        problems.append(f"{len(comp)} modules import each other in a circle:\n    " + "\n    ".join(edges))
    assert not problems, "\n".join(problems)


def test_upward_imports_are_the_allowed_ones():
    assert len(ALLOWED_UPWARD) <= MAX_UPWARD
    upward = {(a, b) for a, targets in GRAPH.items() for b in targets
              if a in RANK and b in RANK and RANK[b] > RANK[a]}
    unexpected = [f"{a} (layer {LAYERS[RANK[a]][0]}) -> {b} (layer {LAYERS[RANK[b]][0]}) at {_where(a, b)}"
                  for a, b in sorted(upward - set(ALLOWED_UPWARD))]
    assert not unexpected, ("imports from a lower layer up to a higher one (move the code down, pass the "
                            "dependency in, or split the module):\n    " + "\n    ".join(unexpected))
    stale = sorted(set(ALLOWED_UPWARD) - upward)
    assert not stale, f"ALLOWED_UPWARD lists imports that no longer go up (remove them): {stale}"


def test_allowed_upward_imports_say_why_at_the_import():
    for (a, b), reason in ALLOWED_UPWARD.items():
        assert reason.strip(), f"{a} -> {b} needs its reason in ALLOWED_UPWARD"
        lines = MODS[a].read_text().splitlines()
        line = GRAPH[a][b]
        around = lines[max(0, line - 3): line]  # the import line and the two above it
        assert any("#" in s for s in around), f"{_where(a, b)}: the upward import {a} -> {b} needs a comment there"


def test_layer_tables_are_consistent():
    entries = [e for _, es, _ in LAYERS for e in es]
    assert len(entries) == len(set(entries)), "a module or package is in two layers"
    for entry in entries:
        assert entry in MODS, f"LAYERS names {entry}, which is not a tokenmill module or package"
