"""Scoring a preference pair's two answers, and the reference they are scored against, never a
second model in memory (field report 002).

`sequence_logps(model, batch)` scores the chosen and rejected answers of a `[chosen; rejected]`
batch with one forward (chunked log-probs: no `2P x T x V` logits). The reference is one of:

(a) fresh adapter (`BaseReference`): the same model with its adapters switched off
    (`disable_adapters()` under `torch.no_grad()`), i.e. the base model the adapter starts from;
(b) continuing a trained adapter (`AdapterSnapshotReference`, `init_adapter=DIR`, Stage A ->
    Stage B): the Stage A policy, kept as a frozen copy of the adapter tensors only (a few MB),
    copied in under `no_grad` for the reference forward and the training values copied back;
(c) `precompute_ref=true` (`precompute_reference`): the log-probs of (a) or (b) computed once
    before training, cached beside the run as safetensors + JSON keyed by what they depend on,
    and read back during training, so the loop does one forward per step instead of two.

DPO (`minitrain.objectives.dpo`) and KTO (`minitrain.objectives.kto`) score against it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from minitrain.parallel import distributed
from minitrain.adapters.lora import disable_adapters
from minitrain.data.collate import IGNORE_INDEX
from minitrain.data.packing import per_sequence
from minitrain.errors import UserError
from minitrain.objectives.losses import chunked_token_logprobs, shift_labels
from minitrain.objectives.sft import batch_token_logprobs, causal_hidden
from minitrain.weights import io_error_reason


# ----------------------------------------------------------------------------- scoring sequences


class SequenceLogps(NamedTuple):
    """Summed completion log-probs and completion token counts of the pairs of one batch, (P,) each."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def num_pairs(batch: dict[str, Any]) -> int:
    """P for a `collate_preference` batch of 2P rows `[chosen; rejected]`."""
    return int(batch.get("num_pairs") or batch["input_ids"].shape[0] // 2)


def sequence_logps(model: nn.Module, batch: dict[str, Any]) -> SequenceLogps:
    """Score chosen and rejected answers with ONE forward of the concatenated `[chosen; rejected]` batch.

    One forward (not two) halves the kernel launches and keeps both halves under the same
    padding, so a pair's two scores differ only by their answers. Log-probs come from
    `chunked_token_logprobs` (no `2P x T x V` logits tensor) in fp32. A `collate_shared_prompt`
    batch (P rows) is scored from its one row per pair, the shared prefix computed once; a packed
    batch (`collate_packed_pairs`) sums each sequence's tokens wherever its row put them.
    """
    if "rejected_targets" in batch:  # collate_shared_prompt: one row [prompt, chosen, rejected] per pair
        hidden = causal_hidden(model, batch)  # (P, T, D)
        head = model.output_projection
        c_t, r_t = batch["chosen_targets"], batch["rejected_targets"]  # (P, T), already shifted
        c = chunked_token_logprobs(hidden, head, c_t).sum(dim=1)  # (P,)
        r = chunked_token_logprobs(hidden, head, r_t).sum(dim=1)
        return SequenceLogps(c, r, (c_t != IGNORE_INDEX).sum(dim=1), (r_t != IGNORE_INDEX).sum(dim=1))
    labels = batch["labels"]  # (rows, T), aligned with input_ids, -100 off the completion
    logps = per_sequence(batch, batch_token_logprobs(model, batch, labels))  # (2P,)
    tokens = per_sequence(batch, shift_labels(labels) != IGNORE_INDEX)  # (2P,) scored tokens per sequence
    P = num_pairs(batch)
    return SequenceLogps(logps[:P], logps[P:], tokens[:P], tokens[P:])


# ----------------------------------------------------------------------------- the reference


class BaseReference:
    """Mode (a), a fresh adapter: the reference is the model with its adapters disabled.

    At step 0 a fresh LoRA (B = 0) makes the policy equal to this base exactly.
    """

    def logps(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) reference log-probs (P,), without a graph."""
        with torch.no_grad(), dropout_off(model), disable_adapters(model):
            s = sequence_logps(model, batch)
        return s.chosen, s.rejected

    def fingerprint(self) -> str:
        return "base model (adapters disabled)"

    def applied(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Within: the model is the reference (its adapters disabled)."""
        return disable_adapters(model)


class AdapterSnapshotReference:
    """Mode (b), continuing a trained adapter: the reference is the policy as it was when made.

    Keeps a frozen copy of the trainable (adapter) tensors only — LoRA A/B (a few MB for a 7B
    model) and any `modules_to_save`, which are copied in full — and, for each reference forward,
    copies them in under `no_grad` and the live training values back afterwards. Create it right
    after `load_adapter(..., trainable=True)`, before any step. The reference forward must run before the policy forward
    of the same step: the copies change the tensors in place, which autograd would catch (an
    in-place error) if a policy graph were alive, instead of giving silently wrong gradients.
    """

    def __init__(self, model: nn.Module):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise UserError("reference: the model has no trainable adapter tensors to snapshot — load the adapter "
                            "with load_adapter(model, folder, trainable=True) first")
        self.names = [n for n, _ in named]
        self.frozen = [p.detach().clone() for _, p in named]

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[nn.Module]:
        """Within: the model's adapter tensors hold the snapshot; after: their training values again."""
        params = dict(model.named_parameters())
        live = [params[n] for n in self.names]
        with torch.no_grad():
            kept = [p.detach().clone() for p in live]
            for p, ref in zip(live, self.frozen):
                p.copy_(ref)
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, value in zip(live, kept):
                    p.copy_(value)

    def applied(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Within: the model is the reference (the snapshot swapped in)."""
        return self.swapped_in(model)

    def logps(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) reference log-probs (P,), without a graph."""
        with torch.no_grad(), dropout_off(model), self.swapped_in(model):
            s = sequence_logps(model, batch)
        return s.chosen, s.rejected

    def fingerprint(self) -> str:
        """A content hash of the snapshot: names, shapes, dtypes and values."""
        h = hashlib.sha256()
        for n, t in zip(self.names, self.frozen):
            h.update(f"{n}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        return "adapter snapshot " + h.hexdigest()


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[None]:
    """Switch off every dropout module, and nothing else, while scoring for the reference / eval.

    Not `model.eval()`: quantized layers change their kernels with the mode (bitsandbytes' int8
    matmul quantizes activations in eval mode, and its CPU 4-bit layer repacks its weight for
    inference on an eval-mode no-grad forward, after which that weight passes no gradient), so
    an eval-mode reference would neither equal the policy at step 0 nor leave training intact.
    """
    switched = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.training]
    for m in switched:
        m.eval()
    try:
        yield
    finally:
        for m in switched:
            m.train()


def make_reference(model: nn.Module, init_adapter: str = "") -> BaseReference | AdapterSnapshotReference:
    """The reference for a run: the adapter snapshot when continuing `init_adapter`, else the base."""
    return AdapterSnapshotReference(model) if init_adapter else BaseReference()


def reference_logps(model: nn.Module, batch: dict[str, Any], reference: BaseReference | AdapterSnapshotReference | None,
                    keys: tuple[str, str], who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's two log-prob vectors for `batch`: the precomputed ones it carries under `keys`,
    else `reference.logps(model, batch)` run now. Call it before the policy forward of the step (see
    `AdapterSnapshotReference`)."""
    if keys[0] in batch:
        return batch[keys[0]].float(), batch[keys[1]].float()
    if reference is None:
        raise ValueError(f"{who}: no reference and the batch carries no {keys[0]}")
    return reference.logps(model, batch)


def attach_precomputed(batch: dict[str, Any], examples: Sequence[dict], keys: dict[str, str],
                       who: str) -> dict[str, Any]:
    """`batch` with the examples' precomputed reference log-probs as (N,) fp32 tensors: `keys` maps an
    example key (`ref_chosen_logp`) to its batch key (`ref_chosen_logps`). Nothing is added when no
    example carries them (the reference then runs in the step); some but not all is a bug of ours."""
    first = next(iter(keys))
    have = [first in ex for ex in examples]
    if any(have):
        if not all(have):
            raise ValueError(f"{who}: some examples have precomputed reference log-probs, some not")
        for example_key, batch_key in keys.items():
            batch[batch_key] = torch.tensor([ex[example_key] for ex in examples], dtype=torch.float32)
    return batch


def reference_cache_key(model: nn.Module, reference: BaseReference | AdapterSnapshotReference,
                        examples: Sequence[dict], amp_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """What the reference log-probs depend on, as a JSON-able dict with its `key` (sha256).

    - the base weights: each safetensors file of `model.source_dir` by resolved path, size and
      mtime (a changed or replaced file changes the key; nothing is read), and config.json;
    - how they sit in memory: every parameter's name, dtype and shape (quantization, base
      dtype, adapter layout), and the autocast dtype;
    - the reference: base, or a content hash of the adapter snapshot;
    - the data: a hash of the tokenized pairs (ids and labels), which covers the data file, the
      tokenizer, the chat format, max_len and truncation at once; and their images' files (path, size, mtime).
    """
    files = []
    source = getattr(model, "source_dir", None)
    if source is not None:
        from minitrain.weights import checkpoint_files

        for f in [*checkpoint_files(source), Path(source) / "config.json"]:
            st = f.stat()
            files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    layout = hashlib.sha256()
    for n, p in model.named_parameters():
        layout.update(f"{n}:{p.dtype}:{tuple(p.shape)};".encode())
    data = hashlib.sha256()
    for ex in examples:
        for k in ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"):
            data.update(json.dumps(ex[k]).encode())
        for image in ex.get("images", ()):  # a prompt's images: each file by path, size and mtime
            st = os.stat(image)
            data.update(json.dumps([image, st.st_size, st.st_mtime_ns]).encode())
    parts = {"weights": files, "layout": layout.hexdigest(), "autocast": str(amp_dtype),
             "reference": reference.fingerprint(), "data": data.hexdigest(), "pairs": len(examples)}
    parts["key"] = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return parts


@torch.no_grad()
def compute_reference_logps(model: nn.Module, reference: BaseReference | AdapterSnapshotReference,
                            examples: Sequence[dict], collate: Callable[[list[dict]], dict[str, Any]],
                            batch_size: int, amp_dtype: torch.dtype | None = None,
                            desc: str = "reference log-probs") -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) reference log-probs of every pair, (N,) fp32 on the CPU, batched with a bar.

    Runs with the model in training mode (as the loop will score the policy; dropout off), so
    that mode-dependent quantized kernels give the reference the policy's numbers at step 0.
    """
    device = next(model.parameters()).device
    chosen, rejected = [], []
    was = model.training
    model.train()
    try:
        for i in tqdm(range(0, len(examples), batch_size), desc=desc, dynamic_ncols=True, disable=None):
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in collate(list(examples[i : i + batch_size])).items()}
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                c, r = reference.logps(model, batch)
            chosen.append(c.float().cpu())
            rejected.append(r.float().cpu())
    finally:
        model.train(was)
    return torch.cat(chosen), torch.cat(rejected)


def precompute_reference(model: nn.Module, reference: BaseReference | AdapterSnapshotReference,
                         examples: Sequence[dict], cache: str | os.PathLike,
                         collate: Callable[[list[dict]], dict[str, Any]], batch_size: int,
                         amp_dtype: torch.dtype | None = None, log: Callable[[str], None] = print) -> bool:
    """Give every example its `ref_chosen_logp` / `ref_rejected_logp`, from `cache` when fresh.

    `cache` is a path stem: `<cache>.safetensors` holds the (N,) tensors, `<cache>.json` the key
    parts (see `reference_cache_key`). A cache whose key differs is stale and rebuilt; both
    files are written to temporary names and renamed. Returns True when the cache was reused.
    Call it before training (mode (c)): the reference is then never run again.
    """
    parts = reference_cache_key(model, reference, examples, amp_dtype)
    stem = Path(cache)
    tensors_path, meta_path = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    reused = False
    if tensors_path.is_file() and meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text())
        except ValueError:
            old = {}
        if old.get("key") == parts["key"]:
            t = load_file(str(tensors_path))
            chosen, rejected = t["ref_chosen_logps"], t["ref_rejected_logps"]
            reused = chosen.shape == (len(examples),) and rejected.shape == (len(examples),)
        if reused:
            log(f"reference log-probs: reusing {tensors_path} ({len(examples)} pairs)")
        else:
            changed = [k for k in parts if k != "key" and old.get(k) != parts[k]]
            why = ", ".join(changed) or "unreadable"
            log(f"reference log-probs: {tensors_path} is stale ({why} changed) — rebuilding")
    if not reused:
        chosen, rejected = compute_reference_logps(model, reference, examples, collate, batch_size, amp_dtype)

        def write() -> None:  # rank 0 alone under torchrun (every rank computed the same values)
            tmp = tensors_path.with_name(f".{tensors_path.name}.tmp")
            try:
                stem.parent.mkdir(parents=True, exist_ok=True)
                save_file({"ref_chosen_logps": chosen.contiguous(), "ref_rejected_logps": rejected.contiguous()},
                          str(tmp))
                os.replace(tmp, tensors_path)
                tmp = meta_path.with_name(f".{meta_path.name}.tmp")
                tmp.write_text(json.dumps(parts, indent=2) + "\n")
                os.replace(tmp, meta_path)
            except (OSError, SafetensorError) as e:
                tmp.unlink(missing_ok=True)
                raise UserError(f"{tensors_path}: cannot write the reference cache: {io_error_reason(e)} — free "
                                f"space or choose a writable out folder") from None

        distributed.main_only(write)
        log(f"reference log-probs: {len(examples)} pairs cached in {tensors_path}")
    if hasattr(examples, "set_values"):  # a token store: one array per key, not a write into each example
        examples.set_values({"ref_chosen_logp": chosen.double().numpy(), "ref_rejected_logp": rejected.double().numpy()})
        return reused
    for ex, c, r in zip(examples, chosen.tolist(), rejected.tolist()):
        ex["ref_chosen_logp"], ex["ref_rejected_logp"] = c, r
    return reused
