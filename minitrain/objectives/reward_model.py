"""Reward models: a scalar head on a decoder's last non-pad token, trained on preference pairs.

The model is any decoder family's causal LM with its `lm_head` taken off and a `score` head
(`nn.Linear(hidden, 1, bias=False)`) put on, so its tensors carry the names of transformers'
`XForSequenceClassification` (`model.*`, `score.weight`) and a saved folder loads there key for key.
The reward of a sequence is the head applied to the hidden state of its last token that is not
`pad_id`, found as transformers finds it (the rightmost position whose id differs from the config's
`pad_token_id`: with pad == eos the eos after an answer is skipped there too).

The loss is TRL's RewardTrainer's (Bradley-Terry): per pair `-logsigmoid(r_c - r_r - margin)`, plus
`center_rewards_coefficient * (r_c + r_r)^2` (Eisenstein et al. 2023). TRL takes the mean over the
batch; here the objective returns the sum over pairs and their number (docs/design.md rule 2), the
same mean for one batch. Metrics are TRL's `accuracy` (share of pairs with r_c > r_r, a tie wrong)
and `margin` (mean r_c - r_r), with the mean rewards of each side; the held-out pass logs them as
`eval/accuracy`, `eval/margin`, ... (`evaluate_dpo`: every pair weighs the same).

    build = with_scalar_head(models.from_hf_config)   # loads a causal LM or a reward-model folder
    attach_score(model, seed, pad_id)                 # a fresh head, when the folder had none
    sequence_rewards(model, input_ids, mask, pad_id)  # (B,) fp32
    ModelReward(folder, build, ...)                   # GRPO's `rewards=model:DIR`: TRL's reward signature
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minitrain.data.collate import collate_preference
from minitrain.errors import UserError
from minitrain.objectives.configs import REWARD_BATCH, SCORE_HEAD
from minitrain.objectives.dpo import collate_shared_prompt, evaluate_dpo
from minitrain.objectives.reference import num_pairs

CLASSIFIER = "ForSequenceClassification"
METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected", "mean_reward")


# ----------------------------------------------------------------------------- the model


def is_reward_config(hf_config: dict[str, Any]) -> bool:
    """Whether a config.json describes a model with a scalar head (`XForSequenceClassification`)."""
    return any(str(a).endswith(CLASSIFIER) for a in hf_config.get("architectures") or ())


def reward_config(hf_config: dict[str, Any], pad_id: int) -> dict[str, Any]:
    """The config.json of the reward model made from a causal LM's: `architectures` renamed
    (`LlamaForCausalLM` -> `LlamaForSequenceClassification`), one label, and `pad_token_id` set, so
    transformers picks the last non-pad token as this module does."""
    archs = [str(a) for a in hf_config.get("architectures") or ()]
    if not archs:
        raise UserError("config.json: no architectures entry — a reward model is saved as "
                        "XForSequenceClassification; add the causal class, e.g. \"architectures\": [\"LlamaForCausalLM\"]")
    name = archs[0].removesuffix("ForCausalLM").removesuffix(CLASSIFIER) + CLASSIFIER
    return {**hf_config, "architectures": [name], "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
            "pad_token_id": pad_id}


def with_scalar_head(build: Callable[[dict[str, Any]], nn.Module]) -> Callable[[dict[str, Any]], nn.Module]:
    """A model builder for reward models: `build(config)` with its `lm_head` removed (a causal
    checkpoint's `lm_head.weight` is skipped on load, never held in memory), and, for a folder saved
    as `XForSequenceClassification`, the `score` head its checkpoint fills."""

    def make(config: dict[str, Any]) -> nn.Module:
        model = build(config)
        if getattr(model, "is_encoder_decoder", False):
            raise ValueError("config.json: an encoder-decoder (T5) model — reward models here are decoders")
        model.config.tie_word_embeddings = False  # the head is gone: nothing to tie it to
        model.lm_head = None
        model.ignore_checkpoint_keys = (*getattr(model, "ignore_checkpoint_keys", ()), r"^lm_head\.")
        model.adapter_task_type = "SEQ_CLS"  # peft's task of a model with a classification head
        model.classification_head = SCORE_HEAD  # the output layer (all-linear leaves it out; it trains whole)
        if is_reward_config(config):
            model.score = nn.Linear(model.input_embeddings.embedding_dim, 1, bias=False)
        return model

    return make


def attach_score(model: nn.Module, seed: int, pad_id: int) -> None:
    """Give a model built by `with_scalar_head` from a causal checkpoint a fresh `score` head, drawn as
    transformers draws it (normal, std `initializer_range`) from `seed`, in fp32 on the model's device;
    its `hf_config` becomes the reward model's (`reward_config`), which a full save writes."""
    if getattr(model, SCORE_HEAD, None) is None:
        emb = model.input_embeddings
        std = float(model.hf_config.get("initializer_range", 0.02))
        generator = torch.Generator().manual_seed(seed)
        w = torch.randn(1, emb.embedding_dim, generator=generator) * std  # (1, D)
        head = nn.Linear(emb.embedding_dim, 1, bias=False, device="meta")
        head.weight = nn.Parameter(w.to(emb.weight.device), requires_grad=False)
        setattr(model, SCORE_HEAD, head)
    model.hf_config = reward_config(model.hf_config, pad_id)


def last_non_pad(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B,) index of each row's rightmost token that is not `pad_id`, as transformers'
    `*ForSequenceClassification` finds it (0 for a row of padding only)."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * (input_ids != pad_id)).argmax(-1)


def sequence_rewards(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     pad_id: int) -> torch.Tensor:
    """(B,) fp32: the scalar head on each row's last non-pad hidden state. The model is asked for that
    position's hidden state only (`read_at`): its last layer then skips the other positions' queries,
    MLP and final norm where it can (models/layers.py `Queries`)."""
    last = model(input_ids, attention_mask, read_at=last_non_pad(input_ids, pad_id))  # (B, D)
    return getattr(model, SCORE_HEAD)(last).squeeze(-1).float()


# ----------------------------------------------------------------------------- the loss


def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                center_rewards_coefficient: float | None = None) -> torch.Tensor:
    """(P,) Bradley-Terry losses as TRL's RewardTrainer: `-logsigmoid(r_c - r_r - margin)`, plus
    `c * (r_c + r_r)^2` with `c = center_rewards_coefficient` (their mean is TRL's loss)."""
    gap = chosen - rejected
    losses = -F.logsigmoid(gap if margin is None else gap - margin)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def collate_reward_pairs(examples: Sequence[dict], pad_id: int, shared_prompt: bool = False) -> dict[str, Any]:
    """`collate_preference`'s `[chosen; rejected]` rows (right-padded with `pad_id`, as TRL's collator),
    plus `margin` (P,) fp32 from the examples (0 where none was read).

    `shared_prompt`: one row `[prefix, chosen rest, rejected rest]` per pair instead (`collate_shared_prompt`:
    the prompt's forward and backward once, rejected never seeing chosen), with `read_at` (P, 2): where
    each answer's scored token (its last that is not `pad_id`, as `last_non_pad` finds it in its own
    sequence) sits in the row."""
    if not shared_prompt:
        batch = collate_preference(examples, pad_id)
    else:
        batch = collate_shared_prompt(examples, pad_id)
        reads = []
        for ex, doc in zip(examples, batch["document_ids"].tolist()):
            n = doc.count(0)  # the shared prefix
            c, r = (int(last_non_pad(torch.tensor(ex[k]), pad_id)) for k in ("chosen_ids", "rejected_ids"))
            # rejected's own tokens follow chosen's in the row
            reads.append([c, r if r < n else len(ex["chosen_ids"]) + r - n])
        batch["read_at"] = torch.tensor(reads)
    batch["margin"] = torch.tensor([float(ex.get("margin", 0.0)) for ex in examples], dtype=torch.float32)
    return batch


class RewardObjective:
    """`(model, batch) -> (loss summed over pairs, number of pairs, metrics)` for a reward model.

    One forward of the `collate_reward_pairs` batch scores both answers of every pair (two rows per pair, or
    with `shared_prompt` one row `[prefix, chosen rest, rejected rest]` read at both answers' ends). Held-out
    evaluation is `evaluate_dpo` over `pair_stats` (`eval/loss`, `eval/accuracy`, ...)."""

    token_level = False
    reference = None

    def __init__(self, pad_id: int, center_rewards_coefficient: float | None = None):
        self.pad_id, self.center = pad_id, center_rewards_coefficient

    def pair_stats(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Per-pair tensors (P,): `loss` (with graph) and the metric values (detached)."""
        P = num_pairs(batch)
        if "read_at" in batch:  # collate_reward_pairs(shared_prompt=True): a row per pair, both answers read
            last = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"],
                         read_at=batch["read_at"])  # (P, 2, D)
            r_c, r_r = getattr(model, SCORE_HEAD)(last).squeeze(-1).float().unbind(-1)
        else:
            rewards = sequence_rewards(model, batch["input_ids"], batch.get("attention_mask"), self.pad_id)  # (2P,)
            r_c, r_r = rewards[:P], rewards[P:]
        losses = reward_loss(r_c, r_r, batch.get("margin"), self.center)
        c, r = r_c.detach(), r_r.detach()
        return {"loss": losses, "accuracy": (c > r).float(), "margin": c - r, "rewards/chosen": c,
                "rewards/rejected": r, "mean_reward": (c + r) / 2}

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, int, dict[str, float]]:
        stats = self.pair_stats(model, batch)
        means = torch.stack([stats[k].mean() for k in METRICS]).tolist()  # one host sync
        return stats["loss"].sum(), num_pairs(batch), dict(zip(METRICS, means))

    def evaluate(self, model: nn.Module, examples: Sequence[dict], collate: Callable[[list[dict]], dict[str, Any]],
                 batch_size: int, amp_dtype: torch.dtype | None = None) -> dict[str, float]:
        """`eval/loss` (mean per pair), `eval/accuracy` and the other metrics over `examples`."""
        return evaluate_dpo(model, self, examples, collate, batch_size, amp_dtype)


# ----------------------------------------------------------------------------- scoring for GRPO


def check_reward_folder(folder: str | Path, key: str = "rewards") -> Path:
    """A folder a reward model can be read from (config.json of an `XForSequenceClassification` and a
    `score.weight` of one row in its safetensors), checked from the headers alone; else one UserError."""
    from minitrain.weights import checkpoint_files, read_config, read_header

    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{key}=model:{folder}: no such folder — give the out/model folder of a reward-model run "
                        f"(recipes/reward_model.py finetune=full), or its merged adapter (minitrain merge)")
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise UserError(f"{key}=model:{folder}: is a LoRA adapter, not a model folder — merge it first "
                        f"(minitrain merge --model BASE --adapter {folder} --out merged/) and pass rewards=model:merged")
    config = read_config(folder)
    shapes = {k: v["shape"] for path in checkpoint_files(folder) for k, v in read_header(path)[0].items()}
    head = shapes.get(f"{SCORE_HEAD}.weight")
    if not is_reward_config(config) or head is None or head[0] != 1:
        what = ("has no scalar head (no score.weight)" if head is None else
                f"has a score head of {head[0]} labels, not 1" if head[0] != 1 else
                f"is not a reward model (architectures {config.get('architectures')})")
        raise UserError(f"{key}=model:{folder}: {what} — give a folder saved by recipes/reward_model.py "
                        f"(finetune=full: out/model; LoRA: minitrain merge of out/adapter) or by transformers' "
                        f"XForSequenceClassification with num_labels=1")
    return folder


class ModelReward:
    """A reward model as a reward function with TRL's signature: `fn(prompts, completions, **columns)
    -> list of float`, scored in batches under `no_grad` (GRPO's `rewards=model:DIR`).

    Each prompt + completion is tokenized by the folder's own tokenizer as `recipes/reward_model.py`
    reads a pair's answer (`[bos] prompt completion [eos]`; a chat prompt through the chat template with
    the completion as the assistant turn), so the model scores what it was trained on. (TRL's GRPO
    tokenizes the joined text without special tokens.) The weights load at the first call.
    """

    def __init__(self, folder: str | Path, build: Callable[[dict[str, Any]], nn.Module], device: str = "auto",
                 precision: str = "auto", batch_size: int = REWARD_BATCH):
        self.folder = check_reward_folder(folder)
        self.build, self.device, self.precision, self.batch_size = build, device, precision, batch_size
        self.__name__ = f"model:{self.folder}"
        self.model: nn.Module | None = None

    def __repr__(self) -> str:
        return f"reward model {self.folder}"

    def load(self) -> nn.Module:
        from minitrain.device import base_dtype, pick_device
        from minitrain.text.tokenizer import Tokenizer
        from minitrain.weights import load_pretrained, read_config

        if self.model is None:
            device = pick_device(self.device)
            self.tok = Tokenizer.from_folder(self.folder)
            pad = read_config(self.folder).get("pad_token_id")  # what the head was trained to look past
            self.pad_id = int(pad) if pad is not None else self.tok.pad_id
            self.model = load_pretrained(self.folder, with_scalar_head(self.build),
                                         dtype=base_dtype(self.precision, device), device=device).eval()
        return self.model

    def ids(self, prompt: Any, completion: Any) -> list[int]:
        """The tokens of one prompt + completion, as the reward model's training read them."""
        tok = self.tok
        if isinstance(prompt, list):  # a conversation; the completion an assistant message list or a string
            turn = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            return list(tok.encode_chat(prompt + turn)[0])
        ids = tok.encode(prompt)
        if tok.bos_id is not None and tok.add_bos and ids[:1] != [tok.bos_id]:
            ids = [tok.bos_id] + ids
        return ids + tok.encode(completion, continuation=True) + ([tok.eos_id] if tok.eos_id is not None else [])

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        model = self.load()
        device = next(model.parameters()).device
        rows = [self.ids(p, c) for p, c in zip(prompts, completions)]
        out: list[float] = []
        for i in range(0, len(rows), self.batch_size):
            part = rows[i : i + self.batch_size]
            T = max(len(r) for r in part)
            ids = torch.tensor([r + [self.pad_id] * (T - len(r)) for r in part], device=device)
            mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in part], device=device)
            out += sequence_rewards(model, ids, mask, self.pad_id).tolist()
        return out

    def weight_bytes(self) -> int:
        """Bytes of the reward model's weights as stored (the memory plan's count, before loading)."""
        from minitrain.weights import checkpoint_files, read_header

        return sum(int(v["data_offsets"][1]) - int(v["data_offsets"][0]) for path in checkpoint_files(self.folder)
                   for k, v in read_header(path)[0].items() if not k.startswith("lm_head."))
