"""The SGLang adapter's use of SGLang, checked against SGLang 0.5.23's source (parsed, never imported).

Source: the installed `sglang` package if there is one, else the wheel named by
COLOCATE_SGLANG_WHEEL (`pip download sglang==0.5.23 --no-deps -d DIR`). Every name checked here
comes from the adapter's own constants, so the test follows what the adapter really uses.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import zipfile
from pathlib import Path

import pytest

from colocate.rollout.protocol import FINISH_REASONS, MEMORY_TAGS
from colocate.rollout.sglang.api import (
    CUDA_GRAPH_ENV,
    DTYPES,
    ENGINE_ATTRIBUTES,
    ENGINE_METHODS,
    LOAD_FORMATS,
    LOGPROB_KEY,
    MEMORY_TAG_CONSTANTS,
    REMOVED_SERVER_ARGS,
    SAMPLING_KEYS,
    SERVER_ARG_NAMES,
    SGLANG_IMPORTS,
    SGLANG_VERSION,
    TOKENIZER_MANAGER_ATTRIBUTES,
    TOKENIZER_MANAGER_METHODS,
)
from colocate.rollout.sglang.weights import BUCKET_KEYS, FLATTENED_BUCKET_FORMAT

WHEEL_ENV = "COLOCATE_SGLANG_WHEEL"


class Source:
    """Files of the sglang package, by path relative to the directory holding `sglang/`."""

    def __init__(self):
        wheel = os.environ.get(WHEEL_ENV)
        if wheel:
            self.zip = zipfile.ZipFile(wheel)
            metadata = next(n for n in self.zip.namelist() if n.endswith(".dist-info/METADATA"))
            version_line = next(line for line in self.zip.read(metadata).decode().splitlines() if line.startswith("Version:"))
            self.version = version_line.split(":", 1)[1].strip()
            return
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip(
                f"no sglang source: sglang is not installed and {WHEEL_ENV} is not set "
                f"(pip download sglang=={SGLANG_VERSION} --no-deps -d DIR)"
            )
        self.zip = None
        self.root = Path(next(iter(spec.submodule_search_locations))).parent
        self.version = importlib.metadata.version("sglang")

    def read(self, rel: str) -> str:
        return self.zip.read(rel).decode() if self.zip else (self.root / rel).read_text()

    def listdir(self, rel: str) -> list[str]:
        if self.zip:
            return sorted(n for n in self.zip.namelist() if n.startswith(rel + "/") and "/" not in n[len(rel) + 1 :])
        return sorted(f"{rel}/{p.name}" for p in (self.root / rel).iterdir())

    def tree(self, rel: str) -> ast.Module:
        return ast.parse(self.read(rel))

    def module_tree(self, dotted: str) -> ast.Module:
        return self.tree(dotted.replace(".", "/") + ".py")


@pytest.fixture(scope="module")
def src() -> Source:
    source = Source()
    assert source.version == SGLANG_VERSION
    return source


def top_level(tree: ast.Module) -> dict[str, ast.AST]:
    return {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def parameters(func: ast.FunctionDef) -> tuple[list[str], list[str]]:
    """(all parameter names, those without a default), `self` left out."""
    args = func.args
    positional = [a.arg for a in args.posonlyargs + args.args if a.arg != "self"]
    required = positional[: len(positional) - len(args.defaults)]
    required += [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    return positional + [a.arg for a in args.kwonlyargs], required


def string_constants(tree: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_imported_names_exist(src):
    for name, module in SGLANG_IMPORTS.items():
        assert name in top_level(src.module_tree(module)), f"{module} defines no {name}"


def test_engine_methods_take_our_keywords(src):
    engine = top_level(src.module_tree(SGLANG_IMPORTS["Engine"]))["Engine"]
    found = methods(engine)
    for name, passed in ENGINE_METHODS.items():
        assert name in found, f"Engine.{name} is gone"
        params, required = parameters(found[name])
        assert set(passed) <= set(params), f"Engine.{name}{tuple(params)} lacks {set(passed) - set(params)}"
        assert set(required) <= set(passed), f"Engine.{name} also requires {set(required) - set(passed)}"


def test_engine_and_tokenizer_manager_attributes(src):
    engine_tree = src.module_tree(SGLANG_IMPORTS["Engine"])
    init = methods(top_level(engine_tree)["Engine"])["__init__"]
    assigned = {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    assert set(ENGINE_ATTRIBUTES) <= assigned
    manager = top_level(src.tree("sglang/srt/managers/tokenizer_manager.py"))["TokenizerManager"]
    manager_attrs = {
        t.attr for n in ast.walk(manager) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Attribute)
    }
    engine_sets = {
        t.attr
        for n in ast.walk(engine_tree)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "tokenizer_manager"
    }
    assert set(TOKENIZER_MANAGER_ATTRIBUTES) <= manager_attrs & engine_sets
    watchdog = top_level(src.tree("sglang/srt/utils/watchdog.py"))["SubprocessWatchdog"]
    assert "stop" in methods(watchdog)
    mixin = methods(top_level(src.tree("sglang/srt/managers/tokenizer_control_mixin.py"))["TokenizerControlMixin"])
    for name, passed in TOKENIZER_MANAGER_METHODS.items():
        params, required = parameters(mixin[name])
        assert isinstance(mixin[name], ast.AsyncFunctionDef)
        assert set(passed) <= set(params) and set(required) <= set(passed)
    io_struct = top_level(src.module_tree(SGLANG_IMPORTS["UpdateWeightVersionReqInput"]))
    assert "new_version" in fields(io_struct["UpdateWeightVersionReqInput"])
    assert {"success", "message"} <= fields(io_struct["FlushCacheReqOutput"])


def server_arg_fields(src) -> dict[str, ast.AnnAssign]:
    """Input fields of ServerArgs: annotated names of the namespace classes (those with _NS_PATH)."""
    found = {}
    for rel in src.listdir("sglang/srt/arg_groups/fields"):
        if not rel.endswith(".py"):
            continue
        for cls in ast.parse(src.read(rel)).body:
            if isinstance(cls, ast.ClassDef) and any(
                isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "_NS_PATH" for t in n.targets) for n in cls.body
            ):
                found.update(
                    {n.target.id: n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
                )
    return found


def test_server_args_define_our_keywords(src):
    found = server_arg_fields(src)
    assert len(found) > 100  # the parse found the namespaces at all
    assert set(SERVER_ARG_NAMES) <= set(found), set(SERVER_ARG_NAMES) - set(found)
    assert not set(REMOVED_SERVER_ARGS) & set(found)
    choices = next(
        ast.literal_eval(k.value)
        for k in ast.walk(found["dtype"].annotation)
        if isinstance(k, ast.keyword) and k.arg == "choices"
    )
    assert set(DTYPES) <= set(choices)
    load_formats = next(
        ast.literal_eval(n.value)
        for n in src.tree("sglang/srt/arg_groups/choices.py").body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "LOAD_FORMAT_CHOICES"
    )
    assert set(LOAD_FORMATS) <= set(load_formats)


def test_sampling_params_accept_our_keys(src):
    cls = top_level(src.tree("sglang/srt/sampling/sampling_params.py"))["SamplingParams"]
    assert set(SAMPLING_KEYS) <= fields(cls), set(SAMPLING_KEYS) - fields(cls)


def test_memory_tags_match_protocol(src):
    values = {
        n.targets[0].id: n.value.value
        for n in src.tree("sglang/srt/constants.py").body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Constant)
    }
    assert {k: values[k] for k in MEMORY_TAG_CONSTANTS} == MEMORY_TAG_CONSTANTS
    assert set(MEMORY_TAG_CONSTANTS.values()) == set(MEMORY_TAGS)


def test_flattened_bucket_payload(src):
    bucket_tree = src.module_tree(SGLANG_IMPORTS["FlattenedTensorBucket"])
    bucket = methods(top_level(bucket_tree)["FlattenedTensorBucket"])
    assert "named_tensors" in parameters(bucket["__init__"])[0]
    assert {"get_flattened_tensor", "get_metadata"} <= set(bucket)
    serializer_module = src.module_tree(SGLANG_IMPORTS["MultiprocessingSerializer"])
    serializer = methods(top_level(serializer_module)["MultiprocessingSerializer"])
    assert parameters(serializer["serialize"])[1] == ["obj"]
    assert FLATTENED_BUCKET_FORMAT in string_constants(src.module_tree(SGLANG_IMPORTS["Engine"]))
    reader = src.tree("sglang/srt/model_executor/model_runner_components/weight_updater.py")
    keys = {n.slice.value for n in ast.walk(reader) if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)}
    assert set(BUCKET_KEYS) <= keys and FLATTENED_BUCKET_FORMAT in string_constants(reader)


def test_cuda_graph_env_is_read(src):
    backend = src.tree("sglang/srt/model_executor/runner_backend/full_cuda_graph_backend.py")
    assert CUDA_GRAPH_ENV in string_constants(backend)


def test_output_shapes(src):
    manager = src.read("sglang/srt/managers/tokenizer_manager.py")
    assert "(logprob, token_id, None)" in manager  # output_token_logprobs entries without text
    assert {LOGPROB_KEY, "weight_version", "finish_reason"} <= string_constants(ast.parse(manager))
    finish_types = set()
    for cls in src.tree("sglang/srt/managers/schedule_batch.py").body:
        if isinstance(cls, ast.ClassDef) and cls.name.startswith("FINISH"):
            for d in ast.walk(methods(cls)["to_json"]):
                if isinstance(d, ast.Dict):
                    finish_types |= {
                        v.value for k, v in zip(d.keys, d.values) if isinstance(k, ast.Constant) and k.value == "type"
                    }
    assert finish_types == set(FINISH_REASONS)
