"""Our models in EleutherAI's lm-evaluation-harness (0.4): `HarnessLM`, an lm-eval `TemplateLM`.

lm-eval asks a model three things: `loglikelihood` (the log-probability of a continuation after a
context, and whether greedy decoding would produce it), `loglikelihood_rolling` (a whole text's
log-probability in windows of the model's length: perplexity tasks) and `generate_until` (greedy
text up to a stop string). Each is answered in batches, and the way lm-eval's own `hf` backend
answers it is followed step for step so the two give the same numbers on the same checkpoint:
the same token ids (the checkpoint's tokenizer with its own bos rule, a context's trailing spaces
moved to the continuation, an empty context scored after bos), the same truncation (the last
`max_length + 1` tokens; the context cut on the left to leave room for the generated tokens), the
same rolling windows and the same greedy decoding, cut at the first stop string.

The model is any of ours (hidden states + `output_projection`), with an adapter or a quantized base
as loaded; `generate` is its family's `generate(model, ids, mask, max_new_tokens=...)` (the engine
never imports `models/`: `minitrain evaluate` passes it in, loads the checkpoint and registers the
class with lm-eval under the name `minitrain`). Needs the `eval` extra (`lm_eval`), imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover - the message is what the user sees
    raise ImportError("lm-evaluation-harness is not installed — pip install 'minitrain[eval]' "
                      "(or pip install 'lm_eval>=0.4,<0.5')") from e

from minitrain.text.tokenizer import Tokenizer

DEFAULT_MAX_LENGTH = 2048  # lm-eval's own default when the config names no length
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default `max_gen_toks`


class HarnessLM(TemplateLM):
    """An lm-eval model over one of ours. `batch_size`: sequences per forward (loglikelihood) or per
    generation batch; `max_length`: default the config's `max_position_embeddings` (else 2048)."""

    def __init__(self, model: nn.Module, tok: Tokenizer, generate: Callable[..., torch.Tensor], *,
                 batch_size: int = 8, max_length: int | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS):
        super().__init__()
        if model.is_encoder_decoder:
            raise ValueError("HarnessLM scores causal models (T5's encoder-decoder is not supported)")
        self.model, self.tok, self._generate = model.eval(), tok, generate
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length or model.hf_config.get("max_position_embeddings") or DEFAULT_MAX_LENGTH)
        self._device = next(model.parameters()).device
        # the text of bos: a string that already begins with it gets no second one (as `hf` does)
        self._bos_text = tok.decode([tok.bos_id], skip_special=False) if tok.bos_id is not None else None

    # ------------------------------------------------------------------ what lm-eval asks of a TemplateLM

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: bos, else eos (as `hf`)."""
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The checkpoint's ids for `string`: bos first when its tokenizer adds one (transformers'
        `add_special_tokens=True`, `hf`'s default) and the string does not already begin with it."""
        if add_special_tokens is None:
            bos = self.tok.add_bos and not (self._bos_text and string.startswith(self._bos_text))
        else:
            bos = add_special_tokens and self.tok.add_bos
        ids = self.tok.encode(string, bos=bos)
        left = kwargs.get("left_truncate_len")
        return ids[-left:] if left else ids

    def tok_decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special=skip_special_tokens)

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation),
        per request; longest first in batches of `batch_size`, right-padded, back in request order."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        size = override_bs or self.batch_size
        for start in range(0, len(order), size):
            batch = order[start:start + size]
            rows, conts = [], []
            for i in batch:
                _, context, cont = requests[i]
                rows.append((context + cont)[-(self.max_length + 1):][:-1])  # the last max_length inputs
                conts.append(cont)
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), self.tok.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for j, r in enumerate(rows):
                ids[j, :len(r)] = torch.tensor(r)
                mask[j, :len(r)] = 1
            hidden = self.model(ids.to(self._device), mask.to(self._device))  # (B, T, D)
            for j, (r, cont) in enumerate(zip(rows, conts)):
                h = hidden[j, len(r) - len(cont):len(r)]  # (n, D): the positions that predict `cont`
                logp = torch.log_softmax(self.model.output_projection(h).float(), dim=-1)  # (n, V)
                target = torch.tensor(cont, device=logp.device)
                greedy = bool((logp.argmax(-1) == target).all())
                results[batch[j]] = (float(logp.gather(1, target[:, None]).sum()), greedy)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood: lm-eval's disjoint rolling windows of `max_length` tokens,
        the first after the prefix token, scored in batches and summed per text."""
        windows, owner = [], []
        for i, req in enumerate(requests):
            (string,) = req.args
            for w in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *w))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, scores):
            totals[i] += logp
        return totals

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop string (`until`, and the eos text), at most
        `max_gen_toks` tokens; batched by equal generation settings, longest context first, left-padded."""
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        reqs = [req.args for req in requests]
        encoded = [self.tok_encode(ctx) for ctx, _ in reqs]
        order = sorted(range(len(reqs)), key=lambda i: (-len(encoded[i]), reqs[i][0]))
        groups: dict[str, list[int]] = {}
        for i in order:
            groups.setdefault(repr(sorted(reqs[i][1].items())), []).append(i)
        out: list[str | None] = [None] * len(reqs)
        for members in groups.values():
            kwargs = dict(reqs[members[0]][1])
            if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
                raise ValueError("generate_until: minitrain's lm-eval model decodes greedily — the task asks for "
                                 "sampling (do_sample / temperature > 0)")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if eos_text not in until:
                until.append(eos_text)
            n_new = int(next((kwargs[k] for k in ("max_gen_toks", "max_new_tokens", "max_tokens") if k in kwargs),
                             self.max_gen_toks))
            keep = self.max_length - n_new
            if keep <= 0:
                raise ValueError(f"generate_until: max_gen_toks={n_new} leaves no room for a context in "
                                 f"max_length={self.max_length}")
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                rows = [encoded[i][-keep:] for i in batch]
                width = max(len(r) for r in rows)
                ids = torch.full((len(rows), width), self.tok.pad_id, dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for j, r in enumerate(rows):  # left-padded, as generation needs
                    ids[j, width - len(r):] = torch.tensor(r)
                    mask[j, width - len(r):] = 1
                gen = self._generate(self.model, ids.to(self._device), mask.to(self._device), max_new_tokens=n_new,
                                     eos_token_id=self.tok.eos_id, pad_token_id=self.tok.pad_id)
                for j, i in enumerate(batch):
                    new = gen[j, width:].tolist()
                    if self.tok.eos_id in new:  # what follows eos is padding
                        new = new[:new.index(self.tok.eos_id)]
                    text = self.tok_decode(new)
                    for stop in until:
                        if stop:
                            text = text.split(stop)[0]
                    out[i] = text
        return out  # type: ignore[return-value]
