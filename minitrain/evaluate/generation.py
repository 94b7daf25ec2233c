"""Generation-based evaluation of seq2seq runs (ROUGE) and early stopping on an eval metric.

    generate_texts(model, examples, tok, generate, ...)   decode the model's outputs on the eval set
    EarlyStopping(metric, patience, min_delta)            when to stop, from the evaluations so far
    GenerationEval(...)                                   the loop's eval hook, all of the above:

        eval_fn(model, step, metrics) -> {"eval/rouge1", "eval/rouge2", "eval/rougeL"[, "stop": True]}

The loop (`minitrain.train`) calls the hook at each evaluation, after its own `eval/loss`, and
merges what it returns into the metrics row; `"stop": True` ends the run after this step. The
hook writes each evaluation's predictions (`out/predictions/step_NNNNNNN.jsonl`, with per-example
scores, to read what the model really says) and keeps the adapter of the best evaluation in
`out/best_adapter` (with `best.json`: step, metric, value).

Generation is a function passed in (the engine never imports `models/`): `generate(model,
input_ids, attention_mask, max_new_tokens=..., num_beams=...) -> (B, 1 + new) ids` whose first
column is the decoder start token, as `models.t5.generate` returns. References are the eval
labels decoded (what the loss trains on, after truncation to `max_target_len`). Under torchrun
every rank calls the hook and generates the whole set (a sharded model needs every rank in each
forward); rank 0 alone logs and writes, and `save_best` is called on every rank (it gathers a
sharded adapter; rank 0 writes).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from minitrain.parallel import distributed
from minitrain.evaluate import rouge
from minitrain.progress import log as log_rank0, strict_json
from minitrain.text.tokenizer import Tokenizer

Generate = Callable[..., torch.Tensor]
BEST_DIR = "best_adapter"
BEST_FILE = "best.json"
PREDICTIONS_DIR = "predictions"
ROUGE_KEYS = tuple(f"eval/{t}" for t in rouge.ROUGE_TYPES)  # eval/rouge1, eval/rouge2, eval/rougeL


# ----------------------------------------------------------------------------- generation


def _pad(rows: Sequence[Sequence[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, S) ids and their (B, S) 1/0 mask."""
    S = max(len(r) for r in rows)
    ids = torch.full((len(rows), S), value, dtype=torch.long)
    mask = torch.zeros((len(rows), S), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def until_eos(ids: Sequence[int], eos: Sequence[int]) -> list[int]:
    """The generated ids before the first eos (the eos and whatever fills the row after it dropped)."""
    out = []
    for i in ids:
        if i in eos:
            break
        out.append(int(i))
    return out


@torch.no_grad()
def generate_texts(
    model: nn.Module,
    examples: Sequence[dict],
    tok: Tokenizer,
    generate: Generate,
    *,
    batch_size: int,
    max_new_tokens: int,
    num_beams: int = 1,
    amp_dtype: torch.dtype | None = None,
) -> list[str]:
    """The model's decoded output for each example's `input_ids`, in order (greedy or beam search).

    The model is put in eval mode (no dropout) for the call and back in its previous mode after.
    """
    device = next(model.parameters()).device
    eos = [tok.eos_id] if tok.eos_id is not None else []
    was_training = model.training
    model.eval()
    texts: list[str] = []
    try:
        for i in range(0, len(examples), batch_size):
            ids, mask = _pad([ex["input_ids"] for ex in examples[i : i + batch_size]], tok.pad_id)
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                out = generate(model, ids.to(device), mask.to(device), max_new_tokens=max_new_tokens,
                               num_beams=num_beams)  # (b, 1 + new), the start token first
            texts += [tok.decode(until_eos(row[1:], eos)) for row in out.tolist()]
    finally:
        model.train(was_training)
    return texts


# ----------------------------------------------------------------------------- early stopping


def default_mode(metric: str) -> str:
    """"min" for losses and perplexities, "max" for scores such as ROUGE."""
    return "min" if metric.endswith(("loss", "ppl")) else "max"


@dataclass
class EarlyStopping:
    """Patience on one metric, evaluation by evaluation.

    - `best` / `best_step`: the best value seen, strictly better than every earlier one; a new best
      is what `update` returns True for (the caller keeps that adapter). Any gain counts here.
    - patience: an evaluation resets the count of evaluations without improvement only if it beats
      the value of the last reset by MORE than `min_delta` (Keras' rule: slow gains add up, so
      +0.0005 per evaluation against min_delta=0.001 resets every other evaluation; a plain
      "better than the best by min_delta" would never reset and stop a run that still improves).
    - `should_stop`: `patience` evaluations in a row without such an improvement (patience 0:
      never). A NaN value is never an improvement.

    The state is a pure function of the (step, value) sequence, so a resumed run rebuilds it by
    replaying the logged evaluations (`replay`).
    """

    metric: str = "eval/rougeL"
    patience: int = 0
    min_delta: float = 0.0
    mode: str = ""  # "max" | "min"; "": from the metric's name (`default_mode`)
    best: float | None = None
    best_step: int | None = None
    reference: float | None = None  # value at the last patience reset
    bad_evals: int = 0

    def __post_init__(self) -> None:
        self.mode = self.mode or default_mode(self.metric)
        if self.mode not in ("max", "min"):
            raise ValueError(f"EarlyStopping: mode must be 'max' or 'min', got {self.mode!r}")
        if self.patience < 0 or not self.min_delta >= 0:
            raise ValueError(f"EarlyStopping: patience ({self.patience}) and min_delta ({self.min_delta}) must be >= 0")

    def _better(self, value: float, than: float, by: float) -> bool:
        return value > than + by if self.mode == "max" else value < than - by

    def update(self, step: int, value: float) -> bool:
        """Record the evaluation at `step`; True when `value` is a new best."""
        value = float(value)
        if math.isnan(value):
            self.bad_evals += 1
            return False
        if self.reference is None or self._better(value, self.reference, self.min_delta):
            self.reference = value
            self.bad_evals = 0
        else:
            self.bad_evals += 1
        if self.best is None or self._better(value, self.best, 0.0):
            self.best, self.best_step = value, step
            return True
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad_evals >= self.patience

    def replay(self, rows: Sequence[dict[str, Any]], before_step: int) -> int:
        """Feed the logged evaluations of steps < `before_step` (metrics.jsonl rows); returns how many."""
        n = 0
        for row in rows:
            if self.metric in row and row.get("step", before_step) < before_step:
                self.update(int(row["step"]), row[self.metric])
                n += 1
        return n

    def describe(self) -> str:
        """One line: the best so far and the patience count."""
        if self.best is None:
            return f"best {self.metric}: none yet"
        line = f"best {self.metric} {self.best:.4f} at step {self.best_step}"
        if self.patience:
            line += f" (no improvement > {self.min_delta:g} for {self.bad_evals}/{self.patience} evals)"
        return line


# ----------------------------------------------------------------------------- the loop's hook


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(strict_json(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


class GenerationEval:
    """`eval_fn(model, step, metrics) -> dict` for `minitrain.train`: ROUGE of generated outputs,
    the best adapter kept in `out/best_adapter`, and early stopping.

    examples: eval examples (`input_ids`, `labels`) from `minitrain.data.readers.read_seq2seq`.
    generate: see the module doc. save_best(model, folder): writes the adapter (and tokenizer) to
        `folder`; called on a new best (on every rank under torchrun, writing from rank 0), into a
        fresh folder that then replaces `out/best_adapter`.
    stopper: the metric to keep the best of and stop on; `metrics` from the loop (e.g. `eval/loss`)
        and this hook's ROUGE keys are both available to it.
    """

    def __init__(
        self,
        examples: Sequence[dict],
        tok: Tokenizer,
        generate: Generate,
        *,
        out_dir: str | os.PathLike,
        save_best: Callable[[nn.Module, Path], Any],
        stopper: EarlyStopping,
        batch_size: int,
        max_new_tokens: int,
        num_beams: int = 1,
        amp_dtype: torch.dtype | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.examples, self.tok, self.generate = list(examples), tok, generate
        self.out = Path(out_dir)
        self.save_best, self.stopper = save_best, stopper
        self.options = dict(batch_size=batch_size, max_new_tokens=max_new_tokens, num_beams=num_beams,
                            amp_dtype=amp_dtype)
        self.log = log or log_rank0
        eos = [tok.eos_id] if tok.eos_id is not None else []
        # inputs as the model saw them, added tokens such as [Question] included
        self.inputs = [tok.decode(until_eos(ex["input_ids"], eos), skip_special=False) for ex in self.examples]
        self.references = [tok.decode(ex["labels"]) for ex in self.examples]  # -100 dropped by decode
        self._replayed = False

    def __call__(self, model: nn.Module, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        if not self._replayed:  # a resumed run: the evaluations before the checkpoint decide the state
            self._resume(step)
        result = self.score(model, step)
        seen = {**metrics, **result}
        if self.stopper.metric not in seen:
            raise KeyError(f"GenerationEval: metric {self.stopper.metric!r} is not among {sorted(seen)}")
        value = seen[self.stopper.metric]
        if self.stopper.update(step, value):
            self._keep_best(model, step, value)
        self.log(f"step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in result.items())
                 + f" | {self.stopper.describe()}")
        if self.stopper.should_stop:
            self.log(f"step {step}: early stop — {self.stopper.metric} did not improve by more than "
                     f"{self.stopper.min_delta:g} in {self.stopper.patience} evaluations; best adapter "
                     f"(step {self.stopper.best_step}) in {self.out / BEST_DIR}")
            result["stop"] = True
        return result

    def score(self, model: nn.Module, step: int) -> dict[str, Any]:
        """Generate, ROUGE against the references, write `out/predictions/step_N.jsonl`; returns the
        `eval/rouge...` means. No best adapter and no early stopping: the evaluation before step 1 and
        `eval_only` call this alone (the stopper counts the loop's evaluations only, so a resumed run,
        which replays metrics.jsonl, keeps the same state)."""
        preds = generate_texts(model, self.examples, self.tok, self.generate, **self.options)
        per_example = [rouge.score(ref, pred) for ref, pred in zip(self.references, preds)]
        n = max(len(per_example), 1)
        result: dict[str, Any] = {f"eval/{t}": sum(s[t].fmeasure for s in per_example) / n for t in rouge.ROUGE_TYPES}
        rows = [{"index": i, "input": src, "prediction": pred, "reference": ref,
                 **{t: s[t].fmeasure for t in rouge.ROUGE_TYPES}}
                for i, (src, pred, ref, s) in enumerate(zip(self.inputs, preds, self.references, per_example))]
        distributed.main_only(lambda: _write_jsonl(self.out / PREDICTIONS_DIR / f"step_{step:07d}.jsonl", rows))
        return result

    def _keep_best(self, model: nn.Module, step: int, value: float) -> None:
        """Write the adapter into a fresh folder, then swap it in for `out/best_adapter` (the files: rank 0)."""
        best, tmp, old = self.out / BEST_DIR, self.out / f".{BEST_DIR}.tmp", self.out / f".{BEST_DIR}.old"

        def clear() -> None:
            for d in (tmp, old):
                shutil.rmtree(d, ignore_errors=True)

        def swap_in() -> None:
            (tmp / BEST_FILE).write_text(json.dumps({"step": step, "metric": self.stopper.metric, "value": value,
                                                     "mode": self.stopper.mode}) + "\n")
            if best.exists():
                best.rename(old)
            tmp.rename(best)
            shutil.rmtree(old, ignore_errors=True)

        distributed.main_only(clear)
        self.save_best(model, tmp)  # every rank: a sharded adapter is gathered for rank 0
        distributed.main_only(swap_in)

    def _resume(self, step: int) -> None:
        self._replayed = True
        n = self.stopper.replay(_read_metrics(self.out / "metrics.jsonl"), before_step=step)
        if n:
            self.log(f"early stopping: {n} earlier evaluations replayed — {self.stopper.describe()}")
        distributed.main_only(self._drop_later_best)

    def _drop_later_best(self) -> None:
        best = self.out / BEST_DIR
        if (best / BEST_FILE).is_file():
            kept = json.loads((best / BEST_FILE).read_text()).get("step")
            if kept != self.stopper.best_step:  # written after the checkpoint, by a run that did not go on
                shutil.rmtree(best)
                self.log(f"{best}: was from step {kept}, after the checkpoint — removed; the next best rewrites it")
