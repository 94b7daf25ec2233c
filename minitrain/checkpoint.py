"""Resumable checkpoints: safetensors + JSON, written to a temporary folder and renamed (rule 7).

`out/checkpoint/` holds everything needed to continue a run exactly:

- `weights.safetensors`: the trainable tensors, by parameter name (frozen ones come from the base);
- `optimizer.safetensors`: per-parameter optimizer tensors as `"<param name>/<key>"`
  (AdamW: `exp_avg`, `exp_avg_sq`); scalar entries (AdamW's `step`) go to `state.json`;
- `ema.safetensors` (with `ema_decay`): the moving average of the trainable tensors, by name;
- `rng.safetensors`: rank 0's torch CPU generator state (uint8) and each CUDA device's state;
  under torchrun, `rng.rank<N>.safetensors` holds rank N's (every rank draws its own dropout);
- `state.json`: step, schedule, data-order state (the Batcher's), running counters, python
  `random` and numpy RNG states (a list, one per rank), the world size, the run's config and
  what the run was made from (`made_from`: fingerprints of the base model and its tokenizer,
  the adapter's r / alpha / targets), so a resume against another run, model or adapter is refused.

No pickle: nothing here can execute code when loaded (field report 003: `torch.load` of an old
checkpoint tripped a CVE guard). Saving writes `checkpoint.tmp-*` completely, moves the previous
checkpoint aside, renames the new one into place, then deletes the old one (`weights.write_folder`);
a crash at any point leaves either a complete `checkpoint/` or a complete `checkpoint.old-*`, which
`find` falls back to (the highest step, if several). A successful save also removes the
`checkpoint.tmp-*` / `checkpoint.old-*` folders that killed runs left behind.
A write that fails (disk full, read-only folder, permissions; safetensors' own errors) is one
`UserError` naming the folder and the reason; the temporary folder is removed and the previous
checkpoint stays in place.

Under torch.distributed every rank calls `save` and `load`: sharded (FSDP) tensors are gathered
whole and each rank's RNG states collected, then rank 0 alone writes; a checkpoint resumes only
at the world size that saved it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from minitrain import distributed
from minitrain.adapters.lora import adapter_signature
from minitrain.errors import UserError
from minitrain.weights import io_error_reason, write_folder

if TYPE_CHECKING:
    from minitrain.optim import AdamW

NAME = "checkpoint"
EMA_FILE = "ema.safetensors"
FORMAT = 2  # 2: per-rank RNG states and world_size (1: rank 0's RNG only; still loads)


def _rng_file(rank: int) -> str:
    return "rng.safetensors" if rank == 0 else f"rng.rank{rank}.safetensors"


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, json) capturing every random generator the loop may draw from, in this process."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = s
    version, internal, gauss = random.getstate()
    js: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        js["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # numpy is a dependency, but the loop does not need it
        pass
    return tensors, js


def _set_rng_state(tensors: dict[str, torch.Tensor], js: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    version, internal, gauss = js["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in js:
        import numpy as np

        kind, keys, pos, has_gauss, cached = js["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _optimizer_state(
    names: dict[torch.Tensor, str], optimizer: torch.optim.Optimizer | AdamW
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Split the optimizer state by parameter name into (whole) tensors and JSON scalars.

    Every rank must call it in the same order under FSDP: sharded state is gathered whole."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for p, st in optimizer.state.items():
        name = names[p]
        for key, v in sorted(st.items()):
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                tensors[f"{name}/{key}"] = distributed.full_tensor(v.detach()).contiguous().cpu()
            elif isinstance(v, torch.Tensor):  # AdamW's step: a 0-d tensor
                v = distributed.full_tensor(v)
                scalars.setdefault(name, {})[key] = {"tensor": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
            else:
                scalars.setdefault(name, {})[key] = v
    return tensors, scalars


def save(
    out_dir: str | os.PathLike,
    named_params: list[tuple[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer | AdamW,
    state: dict[str, Any],
    ema: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `out_dir/checkpoint/` atomically; `state` is the loop's JSON-able state (step, ...);
    `ema`: the moving average of the trainable tensors by name (`minitrain.ema`), when kept.

    A failed write is a `UserError` (`<folder>: cannot write the checkpoint: <reason> — ...`), with
    no `checkpoint.tmp-*` left and the previous checkpoint in place. Under torch.distributed every
    rank calls it (gathers), rank 0 writes, and a failure is raised on every rank.
    """
    out = Path(out_dir)
    final = out / NAME
    names = {p: n for n, p in named_params}
    weights = {n: distributed.full_tensor(p.detach()).contiguous().cpu() for n, p in named_params}
    opt_tensors, opt_scalars = _optimizer_state(names, optimizer)
    ema = {n: distributed.full_tensor(t.detach()).contiguous().cpu() for n, t in ema.items()} if ema else None
    rngs = distributed.gather_objects(_rng_state())  # one (tensors, json) per rank
    full = {**state, "optimizer_scalars": opt_scalars, "rng": [js for _, js in rngs],
            "world_size": len(rngs), "format": FORMAT}

    def fill(tmp: Path) -> None:
        save_file(weights, tmp / "weights.safetensors")
        save_file(opt_tensors, tmp / "optimizer.safetensors")
        if ema is not None:
            save_file(ema, tmp / EMA_FILE)
        for r, (tensors, _) in enumerate(rngs):
            save_file(tensors, tmp / _rng_file(r))
        with open(tmp / "state.json", "w") as f:  # written last: its presence marks a complete folder
            json.dump(full, f)
            f.flush()
            os.fsync(f.fileno())

    def write() -> None:
        try:
            write_folder(final, fill)  # also removes the tmp-* / old-* folders of killed writers
        except (OSError, SafetensorError) as e:  # disk full, read-only, permissions
            raise UserError(_write_error(out, e)) from None

    distributed.main_only(write)
    return final


def _write_error(out: Path, e: BaseException) -> str:
    previous = find(out)
    step = saved_step(previous) if previous is not None else None
    then = (f"rerun with resume=true to continue from the last complete checkpoint (step {'?' if step is None else step})"
            if previous is not None else "rerun (overwrite=true)")
    return (f"{out / NAME}: cannot write the checkpoint: {io_error_reason(e)} — free space or make {out} "
            f"writable, then {then}")


# ----------------------------------------------------------------------------- what a run was made from

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
_SAMPLE = 1 << 20  # bytes of tensor data hashed at each end of a weights file


def model_fingerprint(folder: str | os.PathLike) -> str:
    """A hash of `config.json`, each weights file's header and the first and last MiB of its data.

    Cheap (a few MiB read however large the model) and it tells apart two checkpoints of the same
    shapes (a base and its fine-tune: same headers, other values). OSError if a file does not read."""
    folder = Path(folder)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = min(8 + int.from_bytes(f.read(8), "little"), size)  # the length and the JSON header
            f.seek(0)
            h.update(f.read(head))
            h.update(f.read(_SAMPLE))  # the first MiB of tensor data
            f.seek(max(head, size - _SAMPLE))
            h.update(f.read(_SAMPLE))  # the last
    return h.hexdigest()[:16]


def tokenizer_fingerprint(folder: str | os.PathLike) -> str:
    """A hash of the tokenizer files in `folder` (vocabulary, config, special tokens, chat template)."""
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = Path(folder) / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def made_from(model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint of `model` is tied to: its base folder's fingerprints and its adapter's shape.

    A model not loaded from a folder (`load_pretrained` sets `source_dir`) records None for those."""
    folder = getattr(model, "source_dir", None)
    out: dict[str, Any] = {"model_path": None, "model": None, "tokenizer": None, "adapter": adapter_signature(model)}
    if folder is not None:
        try:
            out.update(model_path=str(folder), model=model_fingerprint(folder), tokenizer=tokenizer_fingerprint(folder))
        except OSError:
            pass
    return out


def check_adapter_base(adapter: str | os.PathLike, model: str | os.PathLike) -> None:
    """Refuse an adapter that a run trained on another base than folder `model` (writes nothing).

    An adapter saved by a run sits in the run's folder (`out/adapter`, `out/best_adapter`) beside its
    checkpoint, whose `made_from` holds the base's fingerprint: the check resume makes, for evaluating
    or exporting. An adapter without its run beside it (copied alone, or PEFT's) is checked by its
    tensors' shapes only (`load_adapter`)."""
    folder = find(Path(adapter).parent)
    if folder is None:
        return
    try:
        saved = json.loads((folder / "state.json").read_text(encoding="utf-8")).get("made_from")
        mine = model_fingerprint(model)
    except (OSError, ValueError, AttributeError):
        return  # unreadable: the loaders report the model; the adapter's own files are checked by shape
    if isinstance(saved, dict) and saved.get("model") and saved["model"] != mine:
        raise UserError(f"{adapter}: was trained on another base model ({saved.get('model_path')}); {model} differs "
                        f"in config.json or weights — pass the base it was trained on")


def check_made_from(saved: dict[str, Any] | None, mine: dict[str, Any], folder: str | os.PathLike) -> None:
    """Refuse a resume whose base model, tokenizer or adapter is not the one the checkpoint was made
    from (keys absent on either side, as in checkpoints written before this was recorded, pass)."""
    if not isinstance(saved, dict):
        return
    was = saved.get("model_path") or "the one it was trained from"
    todo = "or start a new out folder (another out=, or overwrite=true)"
    if saved.get("model") and mine.get("model") and saved["model"] != mine["model"]:
        raise UserError(f"{folder}: the checkpoint was made from another model ({was}); {mine.get('model_path')} "
                        f"differs in config.json or weights — resume with model={was}, {todo}")
    if saved.get("tokenizer") and mine.get("tokenizer") and saved["tokenizer"] != mine["tokenizer"]:
        raise UserError(f"{folder}: the checkpoint was made with another tokenizer (the tokenizer files of {was}); "
                        f"those of {mine.get('model_path')} differ — resume with model={was}, {todo}")
    a, b = saved.get("adapter"), mine.get("adapter")
    if a and b and a != b:
        show = lambda s: ", ".join(f"{k}={v}" for k, v in s.items())  # noqa: E731
        raise UserError(f"{folder}: the checkpoint's adapter is {show(a)}; this run's is {show(b)} — resume with "
                        f"the same lora_* settings (or init_adapter), {todo}")


def check_readable(folder: str | os.PathLike) -> dict[str, Any]:
    """The state of the checkpoint `folder` after checking, without loading anything, that every file
    `load` will read is there and reads (state.json parses; safetensors headers are whole): a
    damaged checkpoint is refused before a resume writes anything."""
    from minitrain.weights import read_header

    folder = Path(folder)
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{folder / 'state.json'}: unreadable ({e}) — the checkpoint is damaged: restore it, or "
                        f"start again without resume=true (overwrite=true)") from None
    need = {"step": int, "optimizer_scalars": dict, "rng": (list, dict)}  # what `save` always writes
    loop = {"run": dict, "counters": dict, "batcher": dict}  # the loop's, when present
    bad = [k for k, t in need.items() if not isinstance(state, dict) or not isinstance(state.get(k), t)]
    bad += [k for k, t in loop.items() if isinstance(state, dict) and k in state and not isinstance(state[k], t)]
    if bad:
        raise UserError(f"{folder / 'state.json'}: damaged ({', '.join(bad)} missing or of the wrong type) — restore "
                        f"the checkpoint, or start again without resume=true (overwrite=true)")
    for name in ("weights.safetensors", "optimizer.safetensors", _rng_file(0)):
        path = folder / name
        if not path.is_file():
            raise UserError(f"{path}: missing — the checkpoint is incomplete: restore it, or start again without "
                            f"resume=true (overwrite=true)")
        try:
            read_header(path)
        except UserError as e:
            raise UserError(f"{e.message.split(' — ')[0]} — the checkpoint is damaged: restore it, or start again "
                            f"without resume=true (overwrite=true)") from None
    return state


def saved_step(folder: Path) -> int | None:
    """The step in `folder/state.json`, or None where it does not read."""
    try:
        step = json.loads((folder / "state.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def find(out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint folder to resume from in `out_dir`, or None.

    `checkpoint/` when complete (it has a state.json); else, after a save killed between its two
    renames, the `checkpoint.old-*` whose state.json reads and holds the highest step (pids order
    nothing). A `checkpoint.tmp-*` is never complete enough to pick.
    """
    out = Path(out_dir)
    if (out / NAME / "state.json").is_file():
        return out / NAME
    olds = [(step, c) for c in sorted(out.glob(f"{NAME}.old-*")) if (step := saved_step(c)) is not None]
    return max(olds, key=lambda sc: sc[0])[1] if olds else None


def fallback_note(out_dir: str | os.PathLike) -> str | None:
    """The line to log when resuming from a `checkpoint.old-*` rather than `checkpoint/`, else None."""
    folder = find(out_dir)
    if folder is None or folder.name == NAME:
        return None
    return f"checkpoint: resuming from {folder.name} (step {saved_step(folder)}) — the last save was interrupted"


def truncate_log(path: str | os.PathLike, step: int) -> list[dict[str, Any]]:
    """For a run resumed at `step`: drop the rows of the JSONL log `path` written after it (they will
    be written again); returns the rows kept. A missing file is an empty log."""
    path = Path(path)
    if not path.is_file():
        return []
    keep = [row for row in map(json.loads, filter(str.strip, path.read_text().splitlines())) if row["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in keep))
    os.replace(tmp, path)
    return keep


def read_state(out_dir: str | os.PathLike) -> dict[str, Any]:
    """The loop state (`state.json`) of the checkpoint in `out_dir`, without restoring anything."""
    folder = find(out_dir)
    if folder is None:
        raise UserError(f"{Path(out_dir) / NAME}: no checkpoint to resume from — run without resume=true")
    try:
        with open(folder / "state.json") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{folder / 'state.json'}: unreadable ({e}) — the checkpoint is damaged: restore it, or "
                        f"start again without resume=true (overwrite=true)") from None


# what may change when a run is extended (`extend=true`): its length, and what follows from it
EXTEND_KEYS = ("max_steps", "epochs", "total_steps", "warmup_steps")


def check_run(saved: dict[str, Any], mine: dict[str, Any], extend: bool = False) -> None:
    """Refuse resuming with settings other than the checkpoint's (`saved`: its `run` dict); with
    `extend`, the run's length (EXTEND_KEYS) may differ, everything else must not."""
    for k, v in saved.items():
        if k not in mine or mine[k] == v or (extend and k in EXTEND_KEYS):
            continue
        hint = " or extend=true to continue the run to a new length," if k in EXTEND_KEYS else ""
        raise UserError(f"resume: checkpoint was made with {k}={v}, this run has {k}={mine[k]} — resume with the "
                        f"same settings,{hint} or start a new out folder")


def load_ema(out_dir: str | os.PathLike, names: list[str]) -> dict[str, torch.Tensor]:
    """The moving average saved with the checkpoint in `out_dir` (whole tensors by name); a
    checkpoint without one, or with other tensors, is a `UserError`."""
    folder = find(out_dir)
    path = folder / EMA_FILE
    if not path.is_file():
        raise UserError(f"{path}: missing — the checkpoint was saved without ema_decay; resume with the run's "
                        f"own settings (ema_decay=0), or start a new out folder")
    tensors = load_file(path)
    if set(tensors) != set(names):
        raise UserError(f"{path}: holds the average of other tensors — resume with the same model, adapters and "
                        f"settings")
    return tensors


def check_world_size(state: dict[str, Any], folder: str | os.PathLike, world: int | None = None) -> None:
    """Refuse resuming at another world size: each rank's RNG state (dropout) is in the checkpoint."""
    world = distributed.world_size() if world is None else world
    saved = int(state.get("world_size", 1))
    if saved != world:
        how = (f"torchrun --nproc_per_node {saved} -m minitrain ..." if saved > 1
               else "one process: python -m minitrain ..., without torchrun")
        raise UserError(f"{folder}: checkpoint was saved by {saved} process{'es' if saved > 1 else ''}, this run "
                        f"has {world} — resume at the same world size ({how} resume=true)")


def load(
    out_dir: str | os.PathLike,
    named_params: list[tuple[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer | AdamW,
) -> dict[str, Any]:
    """Restore trainable weights, optimizer state and RNG states in place; return the loop state.

    The parameters must be the same names and shapes as when saved (the same run), and the
    world size the same: anything else is a `UserError` rather than a silently different
    continuation. Under torch.distributed every rank reads the files and keeps its own shard
    (FSDP) and its own RNG state.
    """
    state = read_state(out_dir)
    folder = find(out_dir)
    check_world_size(state, folder)
    weights = load_file(folder / "weights.safetensors")
    want = {n for n, _ in named_params}
    if set(weights) != want:
        missing, extra = sorted(want - set(weights)), sorted(set(weights) - want)
        raise UserError(
            f"{folder}: checkpoint holds different trainable tensors (missing {missing[:3]}, "
            f"unexpected {extra[:3]}) — resume with the same model, adapters and settings"
        )
    for n, p in named_params:
        if weights[n].shape != p.shape:
            raise UserError(f"{folder}: {n} has shape {tuple(weights[n].shape)}, the model {tuple(p.shape)} "
                            f"— resume with the same model and adapter settings")
    with torch.no_grad():  # every check passed: now restore
        for n, p in named_params:
            p.copy_(distributed.like(weights[n], p))

    # rebuild the optimizer's state dict in torch's format (params by index; minitrain.optim.AdamW
    # uses the same) and let the optimizer place the tensors
    opt_tensors = load_file(folder / "optimizer.safetensors")
    scalars = state.pop("optimizer_scalars")
    sd = optimizer.state_dict()
    index = {}
    for group_sd, group in zip(sd["param_groups"], optimizer.param_groups):
        for i, p in zip(group_sd["params"], group["params"]):
            index[i] = p
    by_name = dict(named_params)
    per_name: dict[str, dict[str, Any]] = {}
    for name, entries in scalars.items():
        for key, v in entries.items():
            is_tensor = isinstance(v, dict) and "tensor" in v
            per_name.setdefault(name, {})[key] = torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"])) if is_tensor else v
    for full_key, t in opt_tensors.items():
        name, key = full_key.rsplit("/", 1)
        ref = by_name.get(name)
        per_name.setdefault(name, {})[key] = distributed.like(t, ref) if ref is not None and t.shape == ref.shape else t
    names = {p: n for n, p in named_params}
    sd["state"] = {i: per_name[names[p]] for i, p in index.items() if names[p] in per_name}
    optimizer.load_state_dict(sd)

    rank = distributed.rank()
    rng = load_file(folder / _rng_file(rank))
    js = state.pop("rng")
    _set_rng_state(rng, js[rank] if isinstance(js, list) else js)  # format 1: rank 0's dict
    return state
