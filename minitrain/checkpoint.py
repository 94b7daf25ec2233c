"""Resumable checkpoints: safetensors + JSON, written to a temporary folder and renamed (rule 7).

`out/checkpoint/` holds everything needed to continue a run exactly:

- `weights.safetensors`: the trainable tensors, by parameter name (frozen ones come from the base);
- `optimizer.safetensors`: per-parameter optimizer tensors as `"<param name>/<key>"`
  (AdamW: `exp_avg`, `exp_avg_sq`); scalar entries (AdamW's `step`) go to `state.json`;
- `ema.safetensors` (with `ema_decay`): the moving average of the trainable tensors, by name;
- `rng.safetensors`: rank 0's torch CPU generator state (uint8) and each CUDA device's state;
  under torchrun, `rng.rank<N>.safetensors` holds rank N's (every rank draws its own dropout),
  written by rank N;
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

Under torch.distributed every rank calls `save` and `load`. Whole tensors (one process, ddp) are
written by rank 0 as above. FSDP shards are not gathered: each rank writes its own rows as
`weights.rank<R>.safetensors`, `optimizer.rank<R>.safetensors`, `ema.rank<R>.safetensors` (their
headers say where the rows go; `checkpoint_shards`), and `state.json` holds `"parts": N`. Every
rank writes (its parts, its `rng` file) into the `checkpoint.tmp-*` folder rank 0 made; rank 0
then checks that it sees every file (out= must be a folder every machine sees), writes state.json
last and renames. A write failing on any rank is one `UserError` on every rank, the temporary
folder removed. `load` reads only the rows each rank now holds, from whole files or parts, so a
checkpoint resumes at another world size and in the other mode (fsdp <-> ddp); the continuation is
exact but for random draws (`world_note`). A missing part is one line naming it (`check_files`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from minitrain.parallel import checkpoint_shards as shards
from minitrain.parallel import distributed
from minitrain.adapters.lora import adapter_signature
from minitrain.errors import UserError
from minitrain.weights import begin_folder, io_error_reason, swap_folder
from minitrain.progress import strict_json

if TYPE_CHECKING:
    from minitrain.optim import AdamW

NAME = "checkpoint"
EMA_FILE = "ema.safetensors"
FORMAT = 3  # 3: per-rank parts under FSDP ("parts"); 2: per-rank RNG states, world_size; 1: rank 0's RNG (all load)


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
    """Split the optimizer state by parameter name into tensors (as they are: shards under FSDP) and
    JSON scalars. Every rank must call it in the same order (a sharded 0-d entry is gathered)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for p, st in optimizer.state.items():
        name = names[p]
        for key, v in sorted(st.items()):
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                tensors[f"{name}/{key}"] = v.detach()
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
    rank calls it and writes its own files (its RNG state; under FSDP its part of every tensor) into
    the temporary folder rank 0 made; rank 0 checks they are all there, writes state.json and
    renames the folder into place. A failure on any rank is raised on every rank.
    """
    out = Path(out_dir)
    final = out / NAME
    world, rank = distributed.world_size(), distributed.rank()
    names = {p: n for n, p in named_params}
    opt_tensors, opt_scalars = _optimizer_state(names, optimizer)
    kinds = {"weights": dict(named_params), "optimizer": opt_tensors, **({"ema": ema} if ema else {})}
    sharded = any(distributed.is_sharded(p) for _, p in named_params)
    if sharded:  # each rank its own rows (no gather)
        mine = {shards.part_file(stem, rank): shards.local_part(ts) for stem, ts in kinds.items()}
    else:  # whole tensors (not sharded: the same on every rank), written by rank 0
        mine = {shards.whole_file(stem): ({n: t.detach().contiguous().cpu() for n, t in ts.items()}, None)
                for stem, ts in kinds.items()} if rank == 0 else {}
    rng_tensors, rng_js = _rng_state()
    full = {**state, "optimizer_scalars": opt_scalars, "rng": distributed.gather_objects(rng_js),
            "world_size": world, "format": FORMAT, **({"parts": world} if sharded else {})}

    made = reason = None
    if rank == 0:  # the temporary folder every rank writes into
        try:
            made = str(begin_folder(final))
        except (OSError, UserError) as e:
            reason = e.message if isinstance(e, UserError) else _write_error(out, io_error_reason(e))
    made, reason = distributed.gather_objects((made, reason))[0]
    if reason:
        _raise_everywhere(reason)
    tmp = Path(made)
    reason = None
    try:
        if not tmp.is_dir():
            reason = (f"{out / NAME}: rank {rank} does not see the folder rank 0 made ({tmp.name}) — out= must be a "
                      f"folder every machine sees (a shared filesystem), then rerun")
        else:
            for fname, (tensors, rows) in mine.items():
                if rows is None:
                    save_file(tensors, tmp / fname)
                else:
                    shards.write_part(tmp / fname, tensors, rows, rank, world)
            save_file(rng_tensors, tmp / _rng_file(rank))
    except (OSError, SafetensorError) as e:  # disk full, read-only, permissions
        reason = _write_error(out, io_error_reason(e) + (f" (rank {rank})" if world > 1 else ""))
    failed = [r for r in distributed.gather_objects(reason) if r]  # (every rank has written: a barrier)
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_everywhere(failed[0])

    def finish() -> None:  # rank 0
        try:
            expected = _files(full.get("parts"), world, ema is not None)
            missing = [f for f in expected if not (tmp / f).is_file()]
            if missing:
                shutil.rmtree(tmp, ignore_errors=True)
                writer = missing[0].rpartition(".rank")[2].partition(".")[0] or "0"
                raise UserError(f"{out / NAME}: rank 0 does not see {missing[0]}, which rank {writer} wrote into "
                                f"{tmp.name} — out= must be a folder every machine sees (a shared filesystem), then "
                                f"rerun")
            with open(tmp / "state.json", "w") as f:  # written last: its presence marks a complete folder
                json.dump(full, f)
                f.flush()
                os.fsync(f.fileno())
            swap_folder(final, tmp)  # also removes the tmp-* / old-* folders of killed writers
        except (OSError, SafetensorError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(_write_error(out, io_error_reason(e))) from None

    distributed.main_only(finish)
    return final


def _files(parts: int | None, world: int, ema: bool) -> list[str]:
    """The tensor files of a checkpoint: whole (`parts` None) or one part per rank, then one RNG file per rank."""
    stems = [*shards.STEMS[:2], *(shards.STEMS[2:] if ema else [])]
    tensors = ([shards.whole_file(s) for s in stems] if parts is None
               else [shards.part_file(s, r) for s in stems for r in range(parts)])
    return tensors + [_rng_file(r) for r in range(world)]


def _raise_everywhere(message: str) -> None:
    """Every rank raises the same error; the CLI prints it once (rank 0)."""
    err = UserError(message)
    err.shared = distributed.world_size() > 1
    raise err


def _write_error(out: Path, reason: str) -> str:
    previous = find(out)
    step = saved_step(previous) if previous is not None else None
    then = (f"rerun with resume=true to continue from the last complete checkpoint (step {'?' if step is None else step})"
            if previous is not None else "rerun (overwrite=true)")
    return f"{out / NAME}: cannot write the checkpoint: {reason} — free space or make {out} writable, then {then}"


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
    distributed.main_only(lambda: check_files(folder, state))  # rank 0 looks; every rank refuses alike
    return state


def check_files(folder: str | os.PathLike, state: dict[str, Any]) -> None:
    """Refuse a checkpoint that lacks a file `load` reads (a part another rank wrote, included) or
    whose safetensors header does not read; one line naming the file and what to do."""
    from minitrain.weights import read_header

    folder = Path(folder)
    parts = state.get("parts")
    for name in _files(parts, int(state.get("world_size", 1)), ema=False):
        path = folder / name
        if not path.is_file():
            if parts is not None and ".rank" in name and not name.startswith("rng"):
                raise UserError(f"{path}: missing — the checkpoint was saved by {parts} ranks, each writing its own "
                                f"part, and this part is not there: copy it into {folder} (on several machines out= "
                                f"must be a folder every machine sees), restore the checkpoint, or start again "
                                f"without resume=true (overwrite=true)")
            raise UserError(f"{path}: missing — the checkpoint is incomplete: restore it, or start again without "
                            f"resume=true (overwrite=true)")
        try:
            read_header(path)
        except UserError as e:
            raise UserError(f"{e.message.split(' — ')[0]} — the checkpoint is damaged: restore it, or start again "
                            f"without resume=true (overwrite=true)") from None


def saved_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """The whole shapes of the trainable tensors in the checkpoint `folder` (either layout), or None
    where it does not read."""
    try:
        state = json.loads((Path(folder) / "state.json").read_text(encoding="utf-8"))
        return shards.Tensors(Path(folder), "weights", state.get("parts")).shapes
    except (OSError, ValueError, SafetensorError, UserError, AttributeError):
        return None


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
    tmp.write_text("".join(strict_json(row) + "\n" for row in keep))
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


def load_ema(out_dir: str | os.PathLike, named: list[tuple[str, torch.Tensor]]) -> None:
    """Copy the moving average saved with the checkpoint in `out_dir` into `named` (name, EMA tensor)
    in place: each rank reads the rows of its shard only. A checkpoint without one, or with other
    tensors, is a `UserError`."""
    folder = find(out_dir)
    parts = read_state(out_dir).get("parts")
    files = [shards.whole_file("ema")] if parts is None else [shards.part_file("ema", r) for r in range(parts)]
    path = folder / files[0]
    if not path.is_file():
        raise UserError(f"{path}: missing — the checkpoint was saved without ema_decay; resume with the run's "
                        f"own settings (ema_decay=0), or start a new out folder")
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise UserError(f"{folder / missing[0]}: missing — the checkpoint was saved by {parts} ranks, each writing "
                        f"its own part, and this part is not there: copy it into {folder}, restore the checkpoint, "
                        f"or start again without resume=true (overwrite=true)")
    src = shards.Tensors(folder, "ema", parts)
    if set(src.shapes) != {n for n, _ in named}:
        raise UserError(f"{path}: holds the average of other tensors — resume with the same model, adapters and "
                        f"settings")
    for name, t in named:
        shards.restore(src, name, t)


def world_note(state: dict[str, Any], world: int | None = None) -> str | None:
    """The line to log when a checkpoint saved by another number of processes resumes, else None.

    The continuation is exact at any world size (the data order and position are global, each
    micro-batch is split across the ranks, loss and gradients are sums over them) except for what
    each rank draws at random: rank r < the saved count continues rank r's saved generators, a new
    rank starts from the seed; so dropout masks (and sampling) differ from an uninterrupted run."""
    world = distributed.world_size() if world is None else world
    saved = int(state.get("world_size", 1))
    if saved == world:
        return None
    return (f"resume: the checkpoint was saved by {saved} process{'es' if saved > 1 else ''}, this run has {world}: "
            f"it continues the same run, except that random draws (dropout masks, sampling) differ from an "
            f"uninterrupted run; without them it is the same to float rounding")


def load(
    out_dir: str | os.PathLike,
    named_params: list[tuple[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer | AdamW,
) -> dict[str, Any]:
    """Restore trainable weights, optimizer state and RNG states in place; return the loop state.

    The parameters must be the same names and shapes as when saved (the same run): anything else
    is a `UserError` rather than a silently different continuation. Under torch.distributed every
    rank calls it and reads only the rows of its own shard (FSDP; all of them for a whole tensor),
    from the whole files or whichever per-rank parts hold them, so a checkpoint resumes at any world
    size and in either mode. Each rank restores its own saved RNG state (at another world size a
    rank the checkpoint has none for keeps its seed: `world_note`).
    """
    state = read_state(out_dir)
    folder = find(out_dir)
    distributed.main_only(lambda: check_files(folder, state))
    parts = state.get("parts")
    weights = shards.Tensors(folder, "weights", parts)
    want = {n for n, _ in named_params}
    if set(weights.shapes) != want:
        missing, extra = sorted(want - set(weights.shapes)), sorted(set(weights.shapes) - want)
        raise UserError(
            f"{folder}: checkpoint holds different trainable tensors (missing {missing[:3]}, "
            f"unexpected {extra[:3]}) — resume with the same model, adapters and settings"
        )
    for n, p in named_params:
        if weights.shapes[n] != tuple(p.shape):
            raise UserError(f"{folder}: {n} has shape {weights.shapes[n]}, the model {tuple(p.shape)} "
                            f"— resume with the same model and adapter settings")
    for n, p in named_params:  # every check passed: now restore
        shards.restore(weights, n, p)

    # rebuild the optimizer's state dict in torch's format (params by index; minitrain.optim.AdamW
    # uses the same) and let the optimizer place the tensors
    opt_tensors = shards.Tensors(folder, "optimizer", parts)
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
    for full_key in opt_tensors.shapes:
        name, key = full_key.rsplit("/", 1)
        ref = by_name.get(name)
        per_name.setdefault(name, {})[key] = (shards.laid_out(opt_tensors, full_key, ref) if ref is not None
                                              else opt_tensors.whole(full_key))
    names = {p: n for n, p in named_params}
    sd["state"] = {i: per_name[names[p]] for i, p in index.items() if names[p] in per_name}
    optimizer.load_state_dict(sd)

    rank = distributed.rank()
    js = state.pop("rng")
    if not isinstance(js, list):  # format 1: rank 0's dict
        js = [js]
    if rank < len(js) and (folder / _rng_file(rank)).is_file():
        _set_rng_state(load_file(folder / _rng_file(rank)), js[rank])
    return state
