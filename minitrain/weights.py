"""Weight IO: load HF-layout safetensors checkpoints into a meta-built model, and save them back.

`load_pretrained` builds the model on the meta device (no memory), checks every checkpoint key and
shape against it from the file headers alone (so a wrong checkpoint fails in a second, before any
weight is read), then reads one tensor at a time straight into its final storage and assigns it
in place of the meta parameter. Peak memory is the finished model plus about one tensor.

Tensors are read with plain file reads, not `safetensors.safe_open`: safe_open memory-maps the
file and hands out tensors backed by that mapping, so every page it touches stays resident (and
counted in RSS) until the mapping closes — a copy of the file on top of the copy we keep. The
safetensors format is small enough to read directly: an 8-byte little-endian header length, a
JSON header `{name: {"dtype", "shape", "data_offsets": [begin, end]}}`, then the raw bytes.

`save_pretrained` writes HF's layout (`model.safetensors`, or `model-0000i-of-0000N.safetensors`
plus `model.safetensors.index.json`) into a temporary folder and renames it into place.
`write_folder` replaces a whole folder by renames (checkpoints, adapters: files that must agree).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode
from tqdm import tqdm

from minitrain.errors import UserError

TensorHook = Callable[[nn.Module, str, torch.Tensor], bool]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# what an HF folder holds beside config.json and the weights, carried over when a trained model is
# saved from a base folder (tokenizer, its special tokens and chat template, generation defaults)
SIDE_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
              "preprocessor_config.json", "processor_config.json",  # (the image processing of a vision model)
              "video_preprocessor_config.json")  # (its video processing)

# safetensors dtype names -> torch dtypes (the format is little-endian, like every host we run on)
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
}

_SHOW = 10  # how many names an error message lists before "and N more"


# ----------------------------------------------------------------------------- reading files


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    """`folder/config.json` as a dict; a missing folder or file, or bad JSON, is a UserError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: no such model folder — pass a folder holding config.json and *.safetensors")
    path = folder / "config.json"
    if not path.is_file():
        raise UserError(f"{path}: not found — a model folder needs the config.json saved with its weights")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e}) — restore the file from the original checkpoint") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(config).__name__} — restore the original file")
    return config


def checkpoint_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards its index names, or the single file."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = list(dict.fromkeys(weight_map.values()))  # unique, in order of first mention
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise UserError(
                f"{index}: not a valid safetensors index ({type(e).__name__}: {e}) — restore it from the original checkpoint"
            ) from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise UserError(
                f"{folder}: shard {_names(missing)} named in {INDEX_FILE} is missing — "
                "finish downloading the checkpoint (every shard the index lists)"
            )
        return [folder / s for s in shards]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = (
        f"only pickle weights ({', '.join(pickles)}) found, which minitrain never loads — convert them to safetensors"
        if pickles
        else "download the *.safetensors files with the config"
    )
    raise UserError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} — {hint}")


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """Parse and check a safetensors header: `({name: {"dtype","shape","data_offsets"}}, data_start)`.

    Everything that can be checked without reading the data is: known dtypes, offsets inside the
    file and matching the shape. A truncated or corrupt file is a UserError naming it.
    """

    def bad(why: str) -> UserError:
        return UserError(f"{path}: not a valid safetensors file ({why}) — it is truncated or corrupt; download it again")

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise bad(f"header of {n} bytes does not fit in {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"entry {name!r} is malformed: {info!r}") from None
        nbytes = _numel(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise bad(f"{name}: offsets {begin}..{end} do not hold a {info['dtype']} tensor of shape {shape}")
        if end > data_len:
            raise bad(f"{name} ends at byte {end} but the file holds {data_len} bytes of data")
    return header, 8 + n


def stored_dtype(info: dict) -> torch.dtype:
    """The torch dtype of a tensor from its safetensors header entry."""
    return _DTYPES[info["dtype"]]


def read_tensor(f, path: Path, data_start: int, info: dict, rows: tuple[int, int] | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Read one tensor from an open file straight into a fresh (owned, not mmapped) tensor.

    `rows`: only rows [start, stop) of dim 0 (contiguous bytes in the file): a rank's FSDP shard.
    `out`: read into this CPU tensor instead (contiguous, of the stored dtype and shape): no copy."""
    shape, offset = list(info["shape"]), data_start + info["data_offsets"][0]
    if rows is not None:
        start, stop = rows
        row_bytes = (info["data_offsets"][1] - info["data_offsets"][0]) // max(shape[0], 1)
        shape[0], offset = stop - start, offset + start * row_bytes
    t = torch.empty(shape, dtype=_DTYPES[info["dtype"]]) if out is None else out
    buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes, writable
    f.seek(offset)
    done = 0
    while done < len(buf):
        got = f.readinto(buf[done:])
        if not got:
            raise UserError(f"{path}: file ended while reading a tensor — it is truncated; download it again")
        done += got
    return t


# ----------------------------------------------------------------------------- loading


Headers = dict[Path, tuple[dict[str, dict], int]]  # file -> (its safetensors header, where its data starts)


def load_pretrained(
    folder: str | os.PathLike,
    build: Callable[[dict[str, Any]], nn.Module],
    *,
    dtype: torch.dtype | None = torch.float32,
    device: str | torch.device = "cpu",
    tensor_hook: TensorHook | None = None,
) -> nn.Module:
    """Build a model from `folder/config.json` on meta and stream its safetensors weights into it.

    Floating tensors are cast to `dtype` (None keeps the stored dtype) and moved to `device`. Each
    arriving tensor is first offered to `tensor_hook(model, key, tensor)`; when it returns True the
    hook has placed the tensor itself (e.g. quantized the Linear it belongs to). Parameters come
    out frozen (`requires_grad=False`): adapter code decides what trains. A checkpoint that does not
    match the model is one UserError listing missing keys, unexpected keys and shape mismatches.
    """
    model, headers = open_pretrained(folder, build)
    folder = Path(folder)
    device = torch.device(device)
    total = sum(len(h) for h, _ in headers.values())
    loaded: set[str] = set()
    parts = checkpoint_parts(model)
    conversions = checkpoint_conversions(model)
    inputs = {k: param for param, (keys, _) in conversions.items() for k in keys}  # checkpoint key -> parameter
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # parameter -> the inputs read so far
    missing_parts = Counter(param for param, _ in parts.values())  # parameter -> its parts not read yet
    with tqdm(total=total, desc=f"loading {folder.name}", unit="tensor", leave=False, disable=None if total > 64 else True) as bar:
        for path, (header, data_start) in headers.items():
            with open(path, "rb") as f:
                # file order: sequential reads
                for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                    t = read_tensor(f, path, data_start, info)
                    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                        t = t.to(dtype)  # rebinding t frees the uncast buffer: one extra tensor at most
                    t = t.to(device)
                    if key in parts:  # one expert's matrix of a fused parameter (the Hub's layout), or its other name
                        param, index = parts[key]
                        _assign_part(model, param, index, t)
                        missing_parts[param] -= 1
                        if (index == () or not missing_parts[param]) and tensor_hook is not None:  # whole: the hook may take it
                            tensor_hook(model, param, model.get_parameter(param).detach())
                    elif key in inputs:  # e.g. MXFP4 blocks / scales: converted once all are read
                        param = inputs[key]
                        got = waiting.setdefault(param, {})
                        got[key] = t
                        keys, convert = conversions[param]
                        if len(got) == len(keys):
                            del waiting[param]
                            _assign_converted(model, folder, param, convert(*(got[k] for k in keys)), dtype)
                            del got
                            if tensor_hook is not None:  # whole now: the hook may take it (quantize experts)
                                tensor_hook(model, param, model.get_parameter(param).detach())
                    elif not (tensor_hook is not None and tensor_hook(model, key, t)):
                        _assign(model, key, t)
                    loaded.add(key)
                    del t
                    bar.update(1)

    _tie_and_check(model, folder, loaded)
    return model


def open_pretrained(folder: str | os.PathLike, build: Callable[[dict[str, Any]], nn.Module]) -> tuple[nn.Module, Headers]:
    """The model of `folder/config.json` built on meta (tied as its config says), checked key for key
    and shape for shape against the checkpoint's headers, and those headers; no weight is read.
    `load_pretrained` streams the weights in next; FSDP's sharded load reads each rank's rows."""
    folder = Path(folder)
    config = read_config(folder)
    model = _build_on_meta(build, config, folder / "config.json")
    headers = {path: read_header(path) for path in checkpoint_files(folder)}
    # keys a family knows are derived, not weights (e.g. old LLaMA saves' rotary_emb.inv_freq)
    ignore = [re.compile(p) for p in getattr(model, "ignore_checkpoint_keys", ())]
    headers = {path: ({k: v for k, v in h.items() if not any(p.search(k) for p in ignore)}, start)
               for path, (h, start) in headers.items()}
    _check_against_model(model, folder, headers)
    model.hf_config = config
    model.source_dir = folder
    return model, headers


class skip_init(TorchFunctionMode):
    """Within it, torch's random and constant initialisers leave their tensor as it is.

    For modules whose every value is overwritten right after they are built: a model built on
    meta before its checkpoint is streamed in, LoRA factors that `reset_lora` draws itself.
    On meta tensors these initialisers run torch's Python decompositions, whose first use imports
    `torch._refs` and sympy: 2.5 to 3 s before the first step (BENCHMARKS.md). Only initialisers
    are touched: `nn.init`'s uniform_, normal_, constant_ and kaiming_uniform_ (what `nn.Linear` and
    `nn.Embedding` use) and the in-place random / fill tensor methods, which the other `nn.init`
    functions call (zeros_, ones_, xavier_*, kaiming_normal_); every other call runs as usual.
    """

    SKIPPED = frozenset({nn.init.uniform_, nn.init.normal_, nn.init.constant_, nn.init.kaiming_uniform_,
                         torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.fill_, torch.Tensor.zero_,
                         torch.Tensor.random_, torch.Tensor.exponential_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _build_on_meta(build: Callable[[dict[str, Any]], nn.Module], config: dict, config_path: Path) -> nn.Module:
    """`build(config)` under the meta device; a ValueError (the model's "bad config") becomes a UserError."""
    try:
        with torch.device("meta"), skip_init():
            model = build(config)
    except ValueError as e:
        msg = str(e)
        # model code says "config.json: ..."; name the actual file
        msg = f"{config_path}:{msg[len('config.json:'):]}" if msg.startswith("config.json:") else f"{config_path}: {msg}"
        raise UserError(msg) from None
    return model


def checkpoint_parts(model: nn.Module) -> dict[str, tuple[str, tuple]]:
    """The model's `checkpoint_parts()` (docs/contracts.md), or {}: checkpoint keys that each fill a part
    of one parameter (an MoE's per-expert matrices of its fused expert weights) -> (parameter key, index)."""
    return model.checkpoint_parts() if hasattr(model, "checkpoint_parts") else {}


def checkpoint_conversions(model: nn.Module) -> dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]]:
    """The model's `checkpoint_conversions()` (docs/contracts.md), or {}: parameters a checkpoint stores
    in another form (gpt-oss's MXFP4 experts) -> (the checkpoint keys, the function of them that gives it)."""
    return model.checkpoint_conversions() if hasattr(model, "checkpoint_conversions") else {}


def _assign_converted(model: nn.Module, folder: Path, key: str, t: torch.Tensor, dtype: torch.dtype | None) -> None:
    """Place a parameter a conversion computed, cast to the load's dtype; a wrong shape is a UserError."""
    want = model.get_parameter(key).shape
    if t.shape != want:
        raise UserError(f"{folder}: {key} converts to shape {tuple(t.shape)}, the model needs {tuple(want)} — "
                        "check that config.json belongs to these weights")
    _assign(model, key, t.to(dtype) if dtype is not None and t.is_floating_point() else t)


def _assign_part(model: nn.Module, key: str, index: tuple, t: torch.Tensor) -> None:
    """Copy `t` into `index` of the parameter `key`, which the first of its parts allocates (frozen,
    in `t`'s dtype and device; its other parts were checked to be in the checkpoint)."""
    owner, _, leaf = key.rpartition(".")
    module = model.get_submodule(owner)
    p = module._parameters[leaf]
    if p.is_meta:
        p = nn.Parameter(torch.empty(p.shape, dtype=t.dtype, device=t.device), requires_grad=False)
        setattr(module, leaf, p)
    with torch.no_grad():
        p[index].copy_(t)


def _check_against_model(model: nn.Module, folder: Path, headers: dict[Path, tuple[dict, int]]) -> None:
    """Compare checkpoint keys and shapes (from headers) to the meta model; one UserError listing all problems.

    Weights the model ties (e.g. `lm_head.weight` to the input embedding) count as present when
    any of their names is in the checkpoint, so a tied checkpoint without `lm_head.weight` is fine.
    A parameter the model fills from parts (`checkpoint_parts`) is present when every part is, and
    a part that is there names the others that are not (a checkpoint with an expert missing); parts that
    each fill the whole parameter are its other names (layouts of other transformers versions): one will do.
    """
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # on meta: only makes the tied names one Parameter, so we can see the groups
    expected = model.state_dict(keep_vars=True)  # includes every name of a tied tensor
    ckpt: dict[str, tuple[list[int], Path, str]] = {}
    duplicated = []
    for path, (header, _) in headers.items():
        for key, info in header.items():
            if key in ckpt:
                duplicated.append(f"{key} (in {ckpt[key][1].name} and {path.name})")
            ckpt[key] = (info["shape"], path, info["dtype"])

    parts = checkpoint_parts(model)
    of_param: dict[str, list[str]] = {}  # parameter -> its part keys
    for part, (param, _) in parts.items():
        of_param.setdefault(param, []).append(part)
    conversions = checkpoint_conversions(model)
    inputs = {k for keys, _ in conversions.values() for k in keys}
    unexpected = [k for k in ckpt if k not in expected and k not in parts and k not in inputs] + duplicated
    unexpected += [f"{k} (and its parts)" for k in of_param if k in ckpt and any(p in ckpt for p in of_param[k])]
    mismatched = [  # (a conversion's input may share its parameter's name: its result is checked as it is placed)
        f"{k}: checkpoint {tuple(ckpt[k][0])} vs model {tuple(t.shape)}"
        for k, t in expected.items()
        if k in ckpt and k not in inputs and list(t.shape) != list(ckpt[k][0])
    ]
    mismatched += [f"{k}: checkpoint {tuple(ckpt[k][0])} vs model {tuple(expected[param][index].shape)}"
                   for k, (param, index) in parts.items()
                   if k in ckpt and list(expected[param][index].shape) != list(ckpt[k][0])]
    # a float weight stored as integers (an int64 cast, a quantized export) would fail mid-matmul
    mistyped = [f"{k}: checkpoint {ckpt[k][2]}, the model needs a float" for k, t in expected.items()
                if k in ckpt and t.dtype.is_floating_point and not _DTYPES[ckpt[k][2]].is_floating_point]
    names_of: dict[int, list[str]] = {}
    for k, t in expected.items():
        names_of.setdefault(id(t), []).append(k)
    missing = [k for names in names_of.values()
               if not any(n in ckpt or n in of_param or n in conversions for n in names) for k in names]
    for param, (keys, _) in conversions.items():  # whole, or every input of its conversion
        if param not in ckpt:
            missing += [k for k in keys if k not in ckpt]
    for param, keys in of_param.items():  # whole, or every part (parts that fill it whole: other names, one is enough)
        if param not in ckpt:
            there = [k for k in keys if k in ckpt]
            if there and all(parts[k][1] == () for k in keys):
                continue
            missing += [k for k in keys if k not in ckpt] if there else [param]
    _raise_if_problems(folder, missing, unexpected, mismatched, mistyped)


def _raise_if_problems(folder: Path, missing: list[str], unexpected: list[str], mismatched: list[str],
                       mistyped: list[str] = ()) -> None:
    parts = []
    if missing:
        parts.append(f"missing keys {_names(missing)}")
    if unexpected:
        parts.append(f"unexpected keys {_names(unexpected)}")
    if mismatched:
        parts.append(f"shape mismatches {_names(mismatched)}")
    if mistyped:
        parts.append(f"dtype mismatches {_names(mistyped)}")
    if mistyped and len(parts) == 1:
        raise UserError(f"{folder}: checkpoint does not match the model: {parts[0]} — these weights were saved as "
                        f"integers; use the original floating-point checkpoint (fp32 / fp16 / bf16 safetensors)")
    if parts:
        raise UserError(
            f"{folder}: checkpoint does not match the model built from its config.json: {'; '.join(parts)} — "
            "check that config.json belongs to these weights (model_type, sizes, tie_word_embeddings)"
        )


def _assign(model: nn.Module, key: str, t: torch.Tensor) -> None:
    """Replace the meta parameter (or buffer) `key` with `t`, frozen. No copy is made."""
    owner, _, leaf = key.rpartition(".")
    module = model.get_submodule(owner)
    if leaf in module._parameters:
        setattr(module, leaf, nn.Parameter(t, requires_grad=False))
    elif leaf in module._buffers:
        module._buffers[leaf] = t
    else:  # keys were checked against the model; a hook must have replaced this module wrongly
        raise RuntimeError(f"{key}: {type(module).__name__} has no parameter or buffer {leaf!r}")


def _tie_and_check(model: nn.Module, folder: Path, loaded: set[str]) -> None:
    """Re-tie after loading, refuse a tied head whose stored copy differs, refuse anything left on meta."""
    before = dict(model.named_parameters(remove_duplicate=False))
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    for name, p in model.named_parameters(remove_duplicate=False):
        old = before[name]
        if p is not old and name in loaded and not old.is_meta and not p.is_meta:
            if old.shape != p.shape or not torch.equal(old, p):
                raise UserError(
                    f"{folder}: config.json ties {name} to another weight, but the checkpoint's {name} differs "
                    "from it — set tie_word_embeddings to false in config.json if the head was trained untied"
                )
    del before
    left = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    left += [n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta]
    _raise_if_problems(folder, left, [], [])


# ----------------------------------------------------------------------------- saving


def save_pretrained(
    model: nn.Module,
    folder: str | os.PathLike,
    config: dict[str, Any],
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `config.json` and the model's weights in HF's safetensors layout; returns the folder.

    `state_dict` replaces the model's own tensors when given (e.g. `minitrain.adapters.merge.merged_state_dict(model)`:
    adapters folded in, HF keys only).

    Floating tensors are cast to `dtype` (None keeps theirs). Above `max_shard_bytes` the weights
    are split into `model-0000i-of-0000N.safetensors` with a `model.safetensors.index.json`. A
    tied weight is written once, under its first name (the embedding), as HF does. Everything is
    written into `<folder>.tmp-<pid>` beside `folder` and swapped in as a whole (`write_folder`):
    a crash or a failure leaves the previous save or the new one, never a mix of their shards.
    Other files already in `folder` (a tokenizer) are carried over; an earlier save's weight
    files are not.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder}: exists and is not a folder — choose another output path")
    tensors = _tensors_to_save(model, state_dict)
    carried = carried_tensors(model)
    files = plan_shard_files({**tensors, **carried}, dtype, max_shard_bytes)

    def fill(tmp: Path) -> None:
        weight_map, total_size = {}, 0
        for fname, keys in files:
            part = {k: carried[k] if k in carried else _prepare(tensors[k], dtype) for k in keys}
            save_file(part, tmp / fname, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(keys, fname))
            total_size += sum(t.numel() * t.element_size() for t in part.values())
            del part
        write_index_and_config(tmp, files, weight_map, total_size, config, dtype)

    try:  # one folder swap: a crash never mixes the shards (or index) of two saves
        write_folder(folder, fill, keep_others=lambda name: not is_weight_file(name))
    except (OSError, SafetensorError) as e:  # disk full, read-only, permissions: nothing half-written stays
        raise UserError(f"{folder}: cannot write the weights: {io_error_reason(e)} — free space or choose a "
                        f"writable folder, then save again") from e
    return folder


def carried_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint tensors a model does not use but a save of it keeps (a multimodal checkpoint's
    towers, a multi-token-prediction head): the keys its `carry_checkpoint_keys` regexes match (docs/
    contracts.md), read as stored from the folder it was loaded from (`source_dir`), bit for bit."""
    patterns = [re.compile(p) for p in getattr(model, "carry_checkpoint_keys", ())]
    source = getattr(model, "source_dir", None)
    out: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(source) if patterns and source is not None else ():
        header, data_start = read_header(path)
        with open(path, "rb") as f:
            for key, info in header.items():
                if any(p.search(key) for p in patterns):
                    out[key] = read_tensor(f, path, data_start, info)
    return out


def _tensors_to_save(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict (or `state_dict`) with tied duplicates dropped; quantized or unloaded
    weights are refused."""
    if state_dict is not None:
        return _dedup(state_dict)
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta:
            raise UserError(f"save_pretrained: parameter {name} was never loaded (still on meta) — load the weights first")
        if not p.is_floating_point():
            raise UserError(
                f"save_pretrained: parameter {name} is {p.dtype} (quantized) — save_pretrained writes float weights; "
                "save the adapter with save_adapter, or load the base in a float dtype to merge and save it"
            )
    return _dedup(model.state_dict(keep_vars=True))


def _dedup(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, t in tensors.items():
        t = t.detach()
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ident in seen:  # tied: the same tensor under a second name (lm_head.weight -> embed_tokens.weight)
            continue
        seen.add(ident)
        out[name] = t
    return out


def plan_shard_files(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None,
                     max_bytes: int) -> list[tuple[str, list[str]]]:
    """HF's file names and the keys each holds: a greedy split in state-dict order, a new file when
    the next tensor would pass `max_bytes` (sizes from shapes and dtypes: sharded tensors count whole)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        item = dtype.itemsize if (dtype is not None and t.is_floating_point()) else t.dtype.itemsize
        n = t.numel() * item
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    if len(shards) == 1:
        return [(SINGLE_FILE, shards[0])]
    return [(f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", keys) for i, keys in enumerate(shards)]


def write_index_and_config(tmp: Path, files: list[tuple[str, list[str]]], weight_map: dict[str, str], total_size: int,
                           config: dict[str, Any], dtype: torch.dtype | None) -> None:
    """The index (when several files) and config.json (its dtype set to `dtype`) of an HF save in `tmp`."""
    if len(files) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    config = dict(config)
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        if "dtype" in config:
            config["dtype"] = config["torch_dtype"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _prepare(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to("cpu").contiguous()


def is_weight_file(name: str) -> bool:
    """A file of an HF weights save: `model.safetensors`, its shards or its index."""
    return name in (SINGLE_FILE, INDEX_FILE) or (name.startswith("model-") and name.endswith(".safetensors"))


def write_folder(folder: Path, fill: Callable[[Path], None], *,
                 keep_others: bool | Callable[[str], bool] = False) -> None:
    """Replace `folder` as a whole: `fill(tmp)` writes every file into `<folder>.tmp-<pid>` beside it,
    then two renames swap it in (a previous `folder` moves to `<folder>.old-<pid>`, and back if the
    second rename fails). A failure removes the temporary folder and re-raises. A crash leaves a
    complete `folder`, or, between the renames, no `folder` but the complete previous one as
    `<folder>.old-<pid>` (checkpoint.find falls back to it).

    After the swap the leftovers of killed writers (`<folder>.tmp-*`, `<folder>.old-*`) are removed:
    one process writes a folder at a time. `keep_others`: what else a previous `folder` holds (a
    tokenizer saved beside an adapter) is hard-linked (or copied) into the new one: everything
    (True), or the top-level names the function accepts (e.g. not the weights of an earlier save).

    The two halves are `begin_folder` and `swap_folder`, for a temporary folder that several
    processes fill (a sharded checkpoint: each rank writes its own part into it).
    """
    tmp = begin_folder(folder)
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_folder(folder, tmp, keep_others=keep_others)


def _target(folder: Path) -> Path:
    folder = Path(os.path.abspath(folder))  # "." gets a name
    if folder.is_symlink():  # replace the link's target, not the link
        folder = folder.resolve()
    return folder


def begin_folder(folder: Path) -> Path:
    """The new, empty `<folder>.tmp-<pid>` that `swap_folder` will put in place of `folder`."""
    folder = _target(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
    if Path.cwd().is_relative_to(folder.resolve()):
        raise UserError(f"{folder}: is (or holds) the current folder, and is replaced as a whole — write into "
                        f"a new subfolder")
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    try:
        if tmp.exists():  # a killed writer with our pid
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def swap_folder(folder: Path, tmp: Path, *, keep_others: bool | Callable[[str], bool] = False) -> None:
    """Put the filled `tmp` (from `begin_folder`) in place of `folder` (see `write_folder`); a failure
    removes `tmp`, leaves the previous `folder` in place, and re-raises."""
    folder = _target(folder)
    old = tmp.with_name(f"{folder.name}.old-{tmp.name.rpartition('.tmp-')[2]}")
    moved = False
    try:
        if keep_others and folder.is_dir():
            keep = (lambda name: True) if keep_others is True else keep_others
            written = {p.name for p in tmp.iterdir()}
            shutil.copytree(folder, tmp, symlinks=True, dirs_exist_ok=True, copy_function=_link_or_copy,
                            ignore=lambda d, names: [n for n in names if Path(d) == folder
                                                     and (n in written or not keep(n))])
        if folder.exists():
            if old.exists():  # a killed writer with our pid; `folder` is complete, so it is not needed
                shutil.rmtree(old)
            os.replace(folder, old)
            moved = True
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if moved and not folder.exists():
            try:
                os.replace(old, folder)  # put the previous folder back in place
            except OSError:
                pass  # it stays complete as <folder>.old-<pid>
        raise
    leftover = re.compile(rf"{re.escape(folder.name)}\.(tmp|old)-\d+")
    try:
        for p in folder.parent.iterdir():
            if leftover.fullmatch(p.name) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
    except OSError:
        pass  # the new folder is in place; leftovers are only clutter


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)


# ----------------------------------------------------------------------------- helpers


def io_error_reason(e: BaseException) -> str:
    """Why a write failed, for a one-line message: "no space left on device", "read-only file system", ...

    safetensors raises its own `SafetensorError("... I/O error: No space left on device (os error
    28)")`, not an OSError, so the errno is read back from its message.
    """
    code = getattr(e, "errno", None)
    if not isinstance(code, int):
        m = re.search(r"os error (\d+)", str(e))
        code = int(m.group(1)) if m else None
    if isinstance(code, int) and code > 0:
        return os.strerror(code).lower()
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOW])
    more = f" and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
    return f"[{shown}{more}]"
