"""FSDP2 (`parallel=fsdp`): shard the model, read each rank's part of the weights, write the result
file by file. No rank ever holds the whole model.

    torchrun --nproc_per_node N -m minitrain RECIPE.py parallel=fsdp ...

The path of a sharded run, as torch's own FSDP2 is meant to be used:

1. `run.load_model` builds the model on the meta device and checks the checkpoint's keys and shapes
   from the file headers; nothing is read (`defer_weights`: the model carries a `Pending` load).
2. Adapters are attached on meta as usual; the few tensors they draw at random (LoRA's A) are made
   real right there, from the run's seed, so every rank holds the same values one process would.
3. `prepare` (from `run.prepare_out_dir` before the audit, or from `train`): `fully_shard` each block
   of `model.block_types`, then the root (`shard`), the embeddings and the head cut by rows of the
   vocabulary beside FSDP2 and never gathered for a frozen head (`shard_vocab`: a rank of N would
   otherwise hold them whole through every step); allocate each rank's shards (`to_empty`); each
   rank reads only the rows of dim 0 it owns from the safetensors files (FSDP2 shards dim 0 in
   `ceil(rows / N)` chunks, as `torch.chunk` does), straight into its shard. A whole tensor exists
   only for what was real before sharding (the adapters) and for `modules_to_save`'s frozen copies.
4. Training runs on the shards; the end keeps them sharded: `gather_whole` hands rank 0 the adapter
   (small), and `save_model` writes a full fine-tune's HF folder one shard file at a time (every
   rank gathers that file's tensors, rank 0 writes it, then frees them).

Gradients are reduce-scattered as sums (divide factor 1): the loop divides by the global target
count, as it does for ddp. A model loaded whole (a recipe that builds its own) is sharded the same
way, before the audit.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from minitrain.parallel import distributed
from minitrain.adapters.lora import applied
from minitrain.adapters.lora_experts import expert_adapters
from minitrain.adapters.quant_experts import QuantizedExpertWeight
from minitrain.errors import UserError
from minitrain.weights import (Headers, begin_folder, checkpoint_conversions, checkpoint_parts, io_error_reason,
                               is_weight_file, plan_shard_files, read_tensor, stored_dtype, swap_folder,
                               write_index_and_config)

_PENDING = "_minitrain_pending_weights"


@dataclass
class Pending:
    """A checkpoint not read yet: where its tensors are, the dtype floating ones are read in, the device."""

    folder: Path
    headers: Headers
    dtype: torch.dtype
    device: torch.device


def defer_weights(model: nn.Module, folder: Path, headers: Headers, dtype: torch.dtype, device: torch.device) -> None:
    """Leave `model` on meta, its floating parameters in `dtype`; `prepare` reads each rank's rows.

    A checkpoint that stores a parameter in another form is read by rows too: the Hub's one tensor per expert
    (`checkpoint_parts`: each rank reads the experts of its rows), another name (a multimodal checkpoint's Hub
    layout), a conversion (`checkpoint_conversions`: gpt-oss's MXFP4 experts, transposed experts), whose
    function acts row by row of dim 0, the experts, so that it is applied to each rank's rows of its inputs.
    Only a conversion whose inputs are not cut along the parameter's dim 0 is refused."""
    stored = {k: list(info["shape"]) for header, _ in headers.values() for k, info in header.items()}
    for param, (keys, _) in _conversions(model, stored).items():
        rows = _shape(model, param)[0]
        if any(stored[k][0] != rows for k in keys):
            raise UserError(f"{folder}: parallel=fsdp reads whole tensors by rows, and this checkpoint stores "
                            f"{param} in a form whose rows are not its rows — use parallel=ddp, or save the model "
                            "once with minitrain (fused experts in a float dtype) and shard that")
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)  # meta to meta: no memory
        p.requires_grad_(False)
    setattr(model, _PENDING, Pending(folder, headers, dtype, device))


def _conversions(model: nn.Module, stored: dict[str, list[int]]) -> dict[str, tuple[tuple[str, ...], Callable]]:
    """The model's `checkpoint_conversions` that this checkpoint needs (its inputs stored, and not the parameter
    itself under its own name in its own shape: Qwen3-VL-MoE's saves)."""
    return {param: (keys, fn) for param, (keys, fn) in checkpoint_conversions(model).items()
            if all(k in stored for k in keys) and not (keys == (param,) and stored[param] == _shape(model, param))}


def _shape(model: nn.Module, name: str) -> list[int]:
    """The shape of parameter `name`, or of the weights a module in its place stands for (quantized experts)."""
    try:
        return list(model.get_parameter(name).shape)
    except AttributeError:
        return list(model.get_submodule(name).shape)


def wanted(cfg: Any) -> bool:
    """Whether this run shards its model: `parallel=fsdp` in a process group (torchrun; one rank too)."""
    return getattr(cfg, "parallel", "ddp") == "fsdp" and distributed.active()


def whole_model_only(cfg: Any, what: str) -> None:
    """One line for a step that needs the whole model on each rank, under `parallel=fsdp`."""
    if getattr(cfg, "parallel", "ddp") == "fsdp":
        raise UserError(f"parallel=fsdp: {what}: needs the whole model on each rank, which a sharded run never "
                        f"holds — use parallel=ddp")


def pending(model: nn.Module) -> Pending | None:
    return getattr(model, _PENDING, None)


def draw_adapters(model: nn.Module, names: list[str], seed: int) -> None:
    """Make the adapter of a model still on meta real on its device: the LoRA layers `names` drawn
    as `apply_lora` draws them on a loaded model (seeded, in the same order, so the values equal one
    process's), and any other real tensor (a loaded adapter) moved to the device."""
    device = pending(model).device
    for p in model.parameters():
        if not p.is_meta and p.device != device:
            p.data = p.data.to(device)
    torch.manual_seed(seed)
    experts = dict(expert_adapters(model))  # an MoE's: named by the expert parameter they adapt
    for name in names:
        layer = experts[name] if name in experts else model.get_submodule(name)
        for lin in (layer.lora_A, layer.lora_B):
            lin.weight = nn.Parameter(torch.empty_like(lin.weight, device=device), requires_grad=lin.weight.requires_grad)
        layer.reset_lora()


def device_of(model: nn.Module) -> torch.device:
    """Where `model` computes: its parameters' device, or for a pending load the device it will be read to."""
    load = pending(model)
    return load.device if load is not None else next(model.parameters()).device


def is_sharded_model(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Put every FSDP group of `model` back to its shards (a no-op when all are, or the model is not
    sharded). FSDP2 leaves the root gathered after a forward, for the backward that reshards it; after
    a forward without one (an evaluation) the root's attributes are the gathered copies. Whoever then
    collects the parameters (the optimizer, a checkpoint, a save) would hold copies that FSDP never
    reduces into (a trained head that never moved): `train()` calls this before it collects them, and
    after each evaluation."""
    if "torch.distributed.fsdp" not in sys.modules:  # nothing was sharded (and a plain run imports no FSDP)
        return
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# ----------------------------------------------------------------------------- sharding


def shard(model: nn.Module, device: torch.device) -> int:
    """`fully_shard` each block of `model.block_types`, then the root; the embeddings and the head
    (`vocab_modules`) are sharded by rows of the vocabulary outside FSDP2 (`shard_vocab`). Returns the
    block count."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (distributed.world_size(),))
    # a block holding a parameter the model reads outside it (T5's position table) goes with the root,
    # whose parameters stay gathered for the whole forward
    outside = {id(p) for p in getattr(model, "used_outside_blocks", list)()}
    blocks = [m for m in model.modules() if isinstance(m, tuple(model.block_types))
              and not any(id(p) in outside for p in m.parameters())]
    for m in blocks:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=shard_vocab(model, mesh))
    for m in [*blocks, model]:  # (per FSDP module: these setters do not recurse)
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return len(blocks)


# ----------------------------------------------------------------------------- the vocabulary's tensors


def vocab_modules(model: nn.Module) -> list[nn.Module]:
    """The input embedding and the output head that `shard_vocab` shards: a plain `nn.Embedding` (no
    padding_idx, no max_norm) and a plain `nn.Linear` head (a LoRA-wrapped or soft-capped one stays
    with FSDP2's root); a tied pair only when both are plain (the shared weight is sharded once)."""
    emb, head = getattr(model, "input_embeddings", None), getattr(model, "output_projection", None)
    plain_emb = type(emb) is nn.Embedding and emb.padding_idx is None and emb.max_norm is None
    plain_head = type(head) is nn.Linear
    if plain_emb and plain_head and head.weight is emb.weight:
        return [emb, head]
    tied = isinstance(head, nn.Module) and isinstance(emb, nn.Module) and any(
        p is q for p in head.parameters() for q in emb.parameters())
    return [] if tied else [m for m, ok in ((emb, plain_emb), (head, plain_head)) if ok]


def shard_vocab(model: nn.Module, mesh: Any) -> set[nn.Parameter]:
    """Cut the parameters of `vocab_modules` by rows (dim 0: the vocabulary) into DTensors of FSDP2's
    layout (`Shard(0)`, `torch.chunk`'s rows), and make the modules compute with the rows each rank
    holds, so that no rank ever holds these tensors whole (FSDP2 would gather each whole on every rank
    for each use: at 50k x 1024 in fp32, 195 MiB each, plus gloo's copy). Returns the new parameters
    (FSDP2's `ignored_params`: they are not FSDP2's).

    - the embedding (`_VocabEmbedding`): every rank looks up the ids of every rank in its rows, and
      the sums give each rank its own rows' embeddings; a trained one gets, on its rows, the
      gradient of every rank's ids.
    - the head: `minitrain.objectives.losses` computes a frozen head's log-probabilities over each
      rank's columns of the vocabulary (`frozen_head_logprobs`, `reduce=`); called as a module (a
      trained head, sampling) it gathers its weight for that call (`distributed.gathered`: the
      gradient summed over ranks into each rank's rows, as FSDP2 reduce-scatters), and a loop of calls
      of each rank's own length takes it gathered once (`distributed.gathered_call`)."""
    from torch.distributed.tensor import DTensor, Shard

    made: dict[int, nn.Parameter] = {}
    for m in vocab_modules(model):
        for name, p in list(m.named_parameters(recurse=False)):
            if id(p) not in made:
                start, stop = _rows(p.shape[0], None)
                local = p.detach()[start:stop].clone()  # (a copy: the whole tensor is freed)
                made[id(p)] = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                              shape=p.shape, stride=p.stride()),
                                           requires_grad=p.requires_grad)
            m._parameters[name] = made[id(p)]
        m.forward = types.MethodType(_embedding_forward if isinstance(m, nn.Embedding) else _head_forward, m)
    return set(made.values())


def _embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    local, start = distributed.local_rows(self.weight)
    return _VocabEmbedding.apply(ids, local, start)


def _head_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else distributed.gathered(self.bias)
    return nn.functional.linear(x, distributed.gathered(self.weight), bias)


class _VocabEmbedding(torch.autograd.Function):
    """Embeddings of this rank's ids (..., D) from each rank's rows of the table: the ids of every
    rank gathered, each rank fills the ones in its rows, the sums (one all-reduce of every rank's
    rows, N x this micro-batch's embeddings) hold each id once. Backward: every rank's gradient rows
    gathered, each rank adds those of its ids into its rows."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, local: torch.Tensor, start: int) -> torch.Tensor:
        flat, m = distributed.gather_rows(ids.reshape(-1))  # (N * m,)
        rel = flat - start
        hit = ((rel >= 0) & (rel < local.shape[0])).nonzero().squeeze(1)
        out = local.new_zeros(flat.shape[0], local.shape[1])  # (N * m, D)
        out[hit] = local[rel[hit]]
        distributed.all_reduce_(out)
        r = distributed.rank()
        ctx.save_for_backward(hit, rel[hit])
        ctx.shape = local.shape
        return out[r * m : r * m + ids.numel()].clone().view(*ids.shape, local.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hit, rows = ctx.saved_tensors
        every, _ = distributed.gather_rows(grad.reshape(-1, grad.shape[-1]).contiguous())  # (N * m, D)
        out = every.new_zeros(ctx.shape)
        out.index_add_(0, rows, every[hit])
        return None, out, None


def prepare(model: nn.Module, device: torch.device, log: Callable[[str], None]) -> None:
    """Shard `model` (once) and, when its weights are pending, read each rank's rows into its shards."""
    if is_sharded_model(model):
        return
    load = pending(model)
    stash: dict[str, torch.Tensor] = {}
    if load is not None:  # what is real already (the adapters, their buffers) is put back after sharding
        stash.update({name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta})
        for name, p in model.named_parameters():
            if not p.is_meta:
                stash[name] = p.detach().clone()
                owner, _, leaf = name.rpartition(".")
                module = model.get_submodule(owner)
                module._parameters[leaf] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    blocks = shard(model, device)
    vocab = [n for n, m in model.named_modules() if m in vocab_modules(model)]
    rows = f"; {' and '.join(vocab)} cut by rows of the vocabulary (each rank computes with its own)" if vocab else ""
    log(f"FSDP2: fully_shard on {blocks} blocks and the root{rows}, over {distributed.world_size()} ranks")
    if load is None:
        return
    model.to_empty(device=device)
    read = _read_rows(model, load, stash, device)
    delattr(model, _PENDING)
    params = list(model.parameters())
    held = sum(p.to_local().numel() * p.element_size() for p in params if distributed.is_sharded(p))
    whole = sum(p.numel() * p.element_size() for p in params)
    log(f"sharded load: this rank read {_size(read)} of {load.folder} and holds {_size(held)} of the model's "
        f"{_size(whole)} (its 1/{distributed.world_size()} of each tensor)")


def _size(n: int) -> str:
    """Bytes for a log line: `812.3 KiB`, `1.25 GiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n / 2**10:,.1f} KiB"


def _read_rows(model: nn.Module, load: Pending, stash: dict[str, torch.Tensor], device: torch.device) -> int:
    """Fill every sharded parameter from the stash or the checkpoint (only this rank's rows), and every buffer whole;
    returns bytes read."""
    where = {key: (path, start, info) for path, (header, start) in load.headers.items() for key, info in header.items()}
    params = dict(model.named_parameters(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for name, p in params.items():
        aliases.setdefault(id(p), []).append(name)
    parts: dict[str, list[tuple[str, tuple]]] = {}  # parameter -> the stored keys that fill it, each with its index
    for key, (param, index) in checkpoint_parts(model).items():
        if key in where:
            parts.setdefault(param, []).append((key, index))
    conversions = _conversions(model, {k: list(info["shape"]) for k, (_, _, info) in where.items()})

    def source(name: str, shape: tuple[int, ...] | None = None) -> tuple[Path, int, dict]:
        renamed = [k for k, index in parts.get(name, ()) if index == ()]  # stored whole under another name
        names = aliases[id(params[name])] if name in params else [name]  # (a weight a quantized module stands for)
        key = next((a for a in [*names, *renamed] if a in where), None)
        if key is None:
            raise UserError(f"parallel=fsdp: {name} is neither in the checkpoint nor made before sharding "
                            f"(an adapter minitrain does not shard) — use parallel=ddp")
        stored = tuple(where[key][2]["shape"])
        if shape is not None and stored != shape:  # e.g. an embedding resized on meta: its rows are not the file's
            raise UserError(f"parallel=fsdp: {name} is {shape} but {stored} in {load.folder} (changed after "
                            f"loading, e.g. resized for new tokens) — use parallel=ddp")
        return where[key]

    read = 0
    with contextlib.ExitStack() as opened, torch.no_grad():
        files: dict[Path, Any] = {}

        def file(path: Path) -> Any:
            if path not in files:
                files[path] = opened.enter_context(open(path, "rb"))
            return files[path]

        def take(at: tuple[Path, int, dict], rows: tuple[int, int] | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
            """The tensor stored `at` (`where`'s (file, data start, header entry)), or its `rows`; counted as read."""
            nonlocal read
            path, data_start, info = at
            t = read_tensor(file(path), path, data_start, info, rows=rows, out=out)
            read += t.numel() * t.element_size()
            return t

        def fill(name: str, local: torch.Tensor, rows: tuple[int, int] | None, shape: tuple[int, ...]) -> None:
            """Write the float tensor `name` of the model's `shape` (its `rows` of dim 0, or whole) into `local`."""
            if name in conversions:  # the function of this rank's rows of its inputs (row by row: the experts)
                keys, convert = conversions[name]
                local.copy_(convert(*(take(where[k], rows) for k in keys)))
            elif any(index != () for _, index in parts.get(name, ())):  # one tensor per expert: this rank's experts
                first = rows[0] if rows else 0
                for key, (e, *rest) in parts[name]:
                    if first <= e < first + local.shape[0]:
                        local[(e - first, *rest)].copy_(take(where[key]))
            else:
                at = source(name, shape)
                direct = local.device.type == "cpu" and local.is_contiguous() and local.dtype == stored_dtype(at[2])
                t = take(at, rows, out=local if direct else None)
                if not direct:  # another dtype or device: through one temporary the size of this shard
                    local.copy_(t.to(device=device, dtype=local.dtype))

        quantized: dict[str, dict[str, torch.Tensor]] = {}  # a quantized layer's tensors, until placed
        for name, p in model.named_parameters():
            local = p.to_local() if distributed.is_sharded(p) else p
            rows = _rows(p.shape[0], local.shape[0]) if p.dim() and local is not p else None
            owner, _, leaf = name.rpartition(".")
            layer = model.get_submodule(owner)
            if hasattr(layer, "quantized") and leaf != "bias":  # adapters/quant_rows.py, quant_experts.py
                if owner not in quantized:
                    if isinstance(layer, QuantizedExpertWeight):  # quantized expert by expert: this rank's experts alone
                        first, stop = rows or (0, layer.shape[0])
                        w = torch.empty((stop - first, *layer.shape[1:]), dtype=load.dtype, device=device)
                        fill(owner, w, rows, tuple(layer.shape))
                        quantized[owner] = layer.quantized(w)
                    else:  # the whole weight quantized as one process does, then this rank's rows kept
                        w = take(source(f"{owner}.weight", (layer.out_features, layer.in_features)))
                        whole = layer.quantized(w.to(device=device, dtype=load.dtype))
                        quantized[owner] = {k: t[rows[0]:rows[1]] if rows else t for k, t in whole.items()}
                    del w
                local.copy_(quantized[owner].pop(leaf))
                if not quantized[owner]:
                    del quantized[owner]
                continue
            if name in stash:
                whole = stash.pop(name)
                local.copy_(whole[rows[0]:rows[1]] if rows else whole)
                continue
            fill(name, local, rows, tuple(p.shape))
        for name, b in list(model.named_buffers()):  # whole on every rank (FSDP2 shards none): Gemma 4's layer scalars
            owner, _, leaf = name.rpartition(".")
            if name in stash:
                t = stash.pop(name)
            else:  # from the checkpoint, in the load's dtype as one process reads it (`to_empty` left garbage)
                t = take(source(name, tuple(b.shape)))
                t = t.to(load.dtype) if t.is_floating_point() else t
            model.get_submodule(owner)._buffers[leaf] = t.to(device)
        st = applied(model)
        for i, (name, live, copy) in enumerate(st.saved if st is not None else ()):  # modules_to_save's base values
            path, data_start, info = source(name)
            whole = read_tensor(file(path), path, data_start, info).to(device=device, dtype=copy.dtype)
            st.saved[i] = (name, live, nn.Parameter(whole, requires_grad=False))
    return read


def _rows(total: int, local: int | None) -> tuple[int, int]:
    """This rank's rows [start, stop) of dim 0 under FSDP2's Shard(0): chunks of ceil(total / N), as
    `torch.chunk` cuts them (the last ranks may hold fewer, or none)."""
    world, rank = distributed.world_size(), distributed.rank()
    chunk = -(-total // world)
    start = min(rank * chunk, total)
    stop = min(start + chunk, total)
    if local is not None and stop - start != local:  # FSDP2 cut it otherwise: our bug, never a wrong weight
        raise RuntimeError(f"FSDP2 shard of {total} rows: rank {rank} holds {local}, expected {stop - start}")
    return start, stop


# ----------------------------------------------------------------------------- the end of training


def gather_whole(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole CPU tensors by name (every rank calls it: a sharded one is gathered). For small sets: the
    adapter, the EMA of an adapter."""
    done: dict[int, torch.Tensor] = {}  # a tied tensor under two names is gathered once
    for t in tensors.values():
        if id(t) not in done:
            done[id(t)] = distributed.full_tensor(t.detach()).contiguous().cpu()
    return {n: done[id(t)] for n, t in tensors.items()}


def save_model(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any],
               side_files: Callable[[Path], None], dtype: torch.dtype | None = torch.float32,
               max_shard_bytes: int = 5 * 2**30, kept: dict[str, torch.Tensor] | None = None) -> None:
    """Write an HF folder of (sharded) `tensors` one shard file at a time: every rank gathers that
    file's tensors, rank 0 writes them into the folder's temporary twin (`weights.begin_folder`),
    then all free them; no rank holds more than one file's worth. Rank 0 then adds the index,
    config.json and `side_files(tmp)` (the tokenizer) and swaps the folder in as a whole (a crash
    leaves the previous save or the new one). A write that fails on rank 0 keeps it gathering (no
    rank is left waiting) and is one `UserError` on every rank at the end. `kept`: tensors the model
    does not hold but the folder keeps (`weights.carried_tensors`: a multimodal checkpoint's towers),
    written as they are stored, in their own dtype."""
    kept = kept or {}
    tensors = {**tensors, **kept}
    files = plan_shard_files(tensors, dtype, max_shard_bytes)
    tmp: Path | None = None
    failure: list[BaseException] = []
    if distributed.rank() == 0:
        try:
            tmp = begin_folder(folder)
        except (OSError, UserError) as e:
            failure.append(e)
    weight_map, total = {}, 0
    for fname, keys in files:
        part = {}
        for k in keys:
            if k in kept:
                part[k] = kept[k]
                continue
            t = distributed.full_tensor(tensors[k].detach())  # a collective: every rank, same order
            part[k] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous().cpu()
        if tmp is not None and not failure:
            try:
                save_file(part, tmp / fname, metadata={"format": "pt"})
            except (OSError, SafetensorError) as e:
                failure.append(e)
        weight_map.update(dict.fromkeys(keys, fname))
        total += sum(t.numel() * t.element_size() for t in part.values())
        del part

    def commit() -> None:
        try:
            if failure:
                raise failure[0]
            write_index_and_config(tmp, files, weight_map, total, config, dtype)
            side_files(tmp)
            swap_folder(folder, tmp, keep_others=lambda name: not is_weight_file(name))
        except (OSError, SafetensorError) as e:
            raise UserError(f"{folder}: cannot write the model: {io_error_reason(e)} — free space or make "
                            f"{folder.parent} writable") from None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)  # (gone already once swapped in)

    distributed.main_only(commit)
