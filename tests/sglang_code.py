"""SGLang's own language-side code, from the installed ``sglang`` wheel, runnable on a CPU.

``import sglang.srt.disaggregation.encoder.receiver`` cannot work on the CI machine: SGLang's
``sglang/__init__.py`` and ``sglang/srt/utils/common.py`` import triton (1 GB) at the top, and the
receiver's imports reach torchvision (whose presence would change what transformers' processors
do in the other CPU tests) and a GPU stack. So the wheel is installed with ``--no-deps``
(scripts/ci_tools.sh), and this module takes from its source files exactly the definitions the
language side uses to call an encoder and to receive from it, unchanged, and executes them as
modules of their real names (so ``pickle`` finds ``EmbeddingData`` where SGLang's encoder puts it):

- ``sglang.srt.utils.common``: ``SafeUnpickler``, ``safe_pickle_loads`` (the allowlist);
- ``sglang.srt.disaggregation.encoder.receiver``: the gRPC client (``_grpc_encode_request``,
  ``_grpc_scheduler_receive_url``, ``MMReceiverGrpc.encode``, which splits a request into parts),
  ``EmbeddingData``, ``MultiModalEmbeddingData`` and the part checks and aggregation,
  ``WaitingZmqRequest._extract_embedding_from_buffer`` (the ``torch.frombuffer`` path), and the
  receive loops themselves: ``MMReceiverBase._recv_mm_data`` (the tokenizer's, zmq_to_tokenizer)
  and, for a scheduler rank (zmq_to_scheduler), ``WaitingZmqRequestGrpc`` with its bases (its
  ``send_encode_request`` registers the rank through ``_ReceiveRegistrationRunner``; its
  ``consume_parts`` and ``_try_recv_mm_data`` receive and assemble) and
  ``MMReceiverBase._drain_scheduler_embeddings`` (the rank's shared socket);
- ``sglang.srt.utils.network`` (``get_zmq_socket_on_host``, how a rank binds its socket) is light
  and imported whole;
- ``sglang.srt.multimodal.cache.identity``: ``_digest_bytes``, how ``mm_content_hashes`` are computed;
- ``sglang.srt.environ`` and ``sglang.srt.multimodal.modality`` are light and imported whole.

Nothing is rewritten or mocked: a definition missing from the wheel fails the load. The definitions
are compiled with postponed annotations (``from __future__ import annotations``), so a name used only
in an annotation (``TokenizedGenerateReqInput``, from ``sglang.srt.managers.io_struct``, which does
not import without SGLang's runtime) need not exist.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

SGLANG_VERSION = "0.5.23"
_POSTPONED_ANNOTATIONS = importlib.import_module("__future__").annotations.compiler_flag

_COMMON = ("_safe_load_torch_storage", "SafeUnpickler", "safe_pickle_load", "safe_pickle_loads")
_RECEIVER = ("_grpc_target", "_normalize_embedding_ports", "_grpc_scheduler_receive_url", "_grpc_encode_request",
             "_gather_blocking_grpc_calls", "EmbeddingData", "_MODALITY_GRID_ATTRS", "_GENERAL_VIDEO_META_ATTRS",
             "_GENERAL_IMAGE_META_ATTRS", "_MIMO_VIDEO_AUDIO_META_ATTRS", "_VIDEO_META_TENSOR_ATTRS",
             "video_meta_attrs_for", "_cat_grid", "MultiModalEmbeddingData", "_validate_embedding_part",
             "_aggregate_embedding_part", "create_part_req_id", "extract_original_req_id",
             "_resolve_embedding_part_request_id", "_embedding_part_matches_request",
             # a scheduler rank's receive (zmq_to_scheduler)
             "_ReceiveRegistrationRunner", "_mark_keep_device_embedding", "WaitingMMRequestStatus",
             "_select_mm_processor_prompt", "WaitingMMRequestBase", "WaitingZmqRequest", "WaitingZmqRequestGrpc",
             "_iter_part_ranges", "_view_pool_buffer_by_modality")
_IDENTITY = ("CONTENT_HASH_PREFIX", "_SHA256_HEX_LENGTH", "parse_content_hash", "_digest_bytes")
# (class, method) -> the module-level name it is loaded under
_METHODS = {("WaitingZmqRequest", "_extract_embedding_from_buffer"): "extract_embedding_from_buffer",
            ("MMReceiverGrpc", "encode"): "grpc_receiver_encode",
            ("MMReceiverBase", "_recv_mm_data"): "recv_mm_data_loop",
            ("MMReceiverBase", "_drain_scheduler_embeddings"): "drain_scheduler_embeddings"}


def _names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def _pick(path: Path, wanted: tuple[str, ...], methods: dict | None = None) -> ast.Module:
    tree = ast.parse(path.read_text(), str(path))
    body, found = [], set()
    for node in tree.body:
        if _names(node) & set(wanted):
            body.append(node)
            found |= _names(node) & set(wanted)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                alias = (methods or {}).get((node.name, getattr(item, "name", None)))
                if alias:
                    item = copy.deepcopy(item)  # the class itself may be loaded too, its method unrenamed
                    item.name = alias
                    body.append(item)
                    found.add(alias)
    missing = (set(wanted) | set((methods or {}).values())) - found
    if missing:
        raise ImportError(f"{path} has no {sorted(missing)}: not the SGLang {SGLANG_VERSION} this test reads")
    return ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))


def _module(name: str, path: Path, tree: ast.Module, namespace: dict) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(path)
    module.__dict__.update(namespace)
    sys.modules[name] = module
    exec(compile(tree, str(path), "exec", flags=_POSTPONED_ANNOTATIONS, dont_inherit=True),
         module.__dict__)
    return module


def load() -> types.SimpleNamespace:
    """The SGLang code above, as modules registered under their real names."""
    version = importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        raise ImportError(f"sglang {version} is installed; these tests read {SGLANG_VERSION} (scripts/ci_tools.sh)")
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    # The packages, without running sglang/__init__.py (it imports triton) or srt/utils/__init__.py.
    for name in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation",
                 "sglang.srt.disaggregation.encoder"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = package

    import asyncio
    import hashlib
    import io
    import itertools
    import logging
    import pickle
    import random
    import threading
    import time
    import weakref
    from abc import ABC, abstractmethod
    from array import array
    from collections import OrderedDict, defaultdict
    from enum import IntEnum
    from http import HTTPStatus
    from typing import Optional

    import numpy as np
    import torch
    import zmq
    from sglang.srt.environ import envs
    from sglang.srt.multimodal.modality import Modality
    from sglang.srt.utils.network import get_zmq_socket_on_host

    common_path = root / "srt" / "utils" / "common.py"
    common = _module("sglang.srt.utils.common", common_path, _pick(common_path, _COMMON),
                     {"io": io, "pickle": pickle, "torch": torch})
    receiver_path = root / "srt" / "disaggregation" / "encoder" / "receiver.py"
    receiver = _module(
        "sglang.srt.disaggregation.encoder.receiver", receiver_path, _pick(receiver_path, _RECEIVER, _METHODS),
        {"asyncio": asyncio, "itertools": itertools, "random": random, "logging": logging,
         "logger": logging.getLogger("sglang.receiver"), "defaultdict": defaultdict, "OrderedDict": OrderedDict,
         "Dict": dict, "List": list, "Optional": Optional, "Tuple": tuple, "HTTPStatus": HTTPStatus, "np": np,
         "torch": torch, "zmq": zmq, "envs": envs, "Modality": Modality, "threading": threading, "time": time,
         "weakref": weakref, "ABC": ABC, "abstractmethod": abstractmethod, "array": array, "IntEnum": IntEnum,
         "safe_pickle_loads": common.safe_pickle_loads, "get_zmq_socket_on_host": get_zmq_socket_on_host})
    identity_path = root / "srt" / "multimodal" / "cache" / "identity.py"
    identity = _module("sglang.srt.multimodal.cache.identity", identity_path, _pick(identity_path, _IDENTITY),
                       {"hashlib": hashlib, "Optional": Optional})
    return types.SimpleNamespace(common=common, receiver=receiver, identity=identity, Modality=Modality, envs=envs,
                                 get_zmq_socket_on_host=get_zmq_socket_on_host, version=version)
