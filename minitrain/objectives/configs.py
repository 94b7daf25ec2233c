"""The objectives' run configs: `TrainConfig` plus each method's keys (KTO, DPO, the preference losses,
reward models, GRPO, distillation), in one module that imports no torch.

The command line reads them before anything heavy is imported, so a mistyped key, a bad value or a
missing file is answered at once (`minitrain.cli`); each objective's module re-exports its config
(`from minitrain.objectives.dpo import DPOConfig` keeps working).
"""

from __future__ import annotations

from dataclasses import dataclass

from minitrain.config import TrainConfig, doc
from minitrain.errors import UserError

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")  # a reference forward per pair
REFERENCE_FREE = ("orpo", "cpo", "simpo")
METHOD_SFT_WEIGHT = {"orpo": 1.0, "cpo": 1.0}  # each method's NLL weight when `sft_weight` is unset (others: 0)
GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
TERMS = ("kd", "ce", "feature", "attention")  # distillation's loss terms, each with a `<term>_weight`


@dataclass
class KTOConfig(TrainConfig):
    """A KTO run: `TrainConfig` plus KTO's keys (names and defaults as TRL's KTOConfig)."""

    beta: float = doc(0.1, "how far the policy may move from the reference (higher: less)", gt=0)
    desirable_weight: float = doc(1.0, "weight of the desirable (label true) rows' losses", gt=0)
    undesirable_weight: float = doc(1.0, "weight of the undesirable (label false) rows' losses", gt=0)
    precompute_ref: bool = doc(False, "compute the reference log-probs once before training, cached in out/ref_logps")
    ref_batch_size: int = doc(0, "rows per batch when precomputing the reference (0: 2 x batch_size)", ge=0)

    def check(self) -> None:
        super().check()
        if self.finetune == "full":
            raise UserError("finetune=full: KTO's reference is the base model, which minitrain gets by disabling the "
                            "adapters — use finetune=lora")
        if self.batch_size < 2:
            raise UserError("batch_size=1: KTO estimates its KL reference point from mismatched prompt-completion "
                            "pairs within a batch, which needs at least 2 rows — use batch_size=2 or more")


def shared_prompt_key():
    """The `shared_prompt` key of the pair objectives (DPO's, the reward model's)."""
    return doc(False, "one row [prompt, chosen, rejected] per pair: the prompt's forward and backward run once "
                      "(exact; faster when prompts are long)")


@dataclass
class DPOConfig(TrainConfig):
    """A DPO run: `TrainConfig` plus the preference-loss keys (names and defaults as TRL's DPOConfig)."""

    beta: float = doc(0.1, "how far the policy may move from the reference (higher: less); IPO's tau", gt=0)
    loss_type: str = doc("sigmoid", "preference loss", choices=DPO_LOSS_TYPES)
    label_smoothing: float = doc(0.0, "probability a preference label is flipped: sigmoid (cDPO) and robust only",
                                 ge=0, lt=0.5)
    sft_weight: float = doc(0.0, "weight of an NLL term on the chosen answers (per-token mean per pair; RPO)", ge=0)
    precompute_ref: bool = doc(False, "compute the reference log-probs once before training, cached in out/ref_logps")
    ref_batch_size: int = doc(0, "pairs per batch when precomputing the reference (0: 2 x batch_size)", ge=0)
    drop_identical_pairs: bool = doc(False, "drop pairs whose chosen and rejected are the same tokens (counted); "
                                            "else such a pair is an error naming its line")
    shared_prompt: bool = shared_prompt_key()
    packing: bool = doc(False, "pack each micro-batch's chosen and rejected sequences into rows of up to max_len "
                               "tokens (positions restart, attention stays inside each sequence; same loss)")

    def check(self) -> None:
        super().check()
        self.check_layout()
        if self.finetune == "full":
            raise UserError(f"finetune=full: loss_type={self.loss_type}'s reference is the base model, which "
                            f"minitrain gets by disabling the adapters — use finetune=lora (or a reference-free "
                            f"loss_type: orpo, cpo, simpo)")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust"):
            raise UserError(f"label_smoothing={self.label_smoothing}: has no meaning for loss_type={self.loss_type} "
                            f"— use loss_type=sigmoid or robust, or label_smoothing=0")

    def check_layout(self) -> None:
        """How pairs are laid out in rows: shared_prompt or packing, not both."""
        if self.packing and self.shared_prompt:
            raise UserError("packing=true: does not combine with shared_prompt=true — use shared_prompt for long "
                            "prompts, packing for short pairs of varied length")


@dataclass
class PreferenceConfig(DPOConfig):
    """A preference run on pairs: DPO's keys, `loss_type` also orpo | cpo | simpo, and SimPO's margin."""

    loss_type: str = doc("sigmoid", "preference loss: DPO's sigmoid | ipo | hinge | robust (a reference forward "
                                    "per pair), or orpo | cpo | simpo (no reference)",
                         choices=DPO_LOSS_TYPES + REFERENCE_FREE)
    simpo_gamma: float = doc(0.5, "SimPO's target reward margin (loss_type=simpo; TRL's default)", ge=0)
    sft_weight: float | None = doc(None, "weight of an NLL term on the chosen answers (per-token mean per pair); "
                                         "unset: the method's own, 1 for orpo and cpo (ORPO as published, TRL's "
                                         "cpo_alpha), 0 for the DPO losses and simpo", ge=0)

    def check(self) -> None:
        if self.sft_weight is None:  # resolved here, so out/config.json records the weight the run used
            self.sft_weight = METHOD_SFT_WEIGHT.get(self.loss_type, 0.0)
        if self.loss_type in REFERENCE_FREE:
            if self.precompute_ref:
                raise UserError(f"precompute_ref=true: loss_type={self.loss_type} uses no reference model — "
                                f"drop precompute_ref, or use a DPO loss_type (sigmoid, ipo, hinge, robust)")
            if self.loss_type == "orpo" and not self.sft_weight:
                raise UserError("sft_weight=0: ORPO is NLL + beta x odds ratio, so it needs the NLL term — "
                                "use sft_weight=1 (ORPO as published), or loss_type=simpo for a loss without one")
            if self.label_smoothing and self.loss_type == "orpo":
                raise UserError(f"label_smoothing={self.label_smoothing}: has no meaning for loss_type=orpo "
                                f"— use label_smoothing=0")
            self.check_layout()
            if self.shared_prompt:
                raise UserError(f"shared_prompt=true: loss_type={self.loss_type} is scored on [chosen; rejected] rows "
                                f"only — drop shared_prompt (packing=true also saves padding)")
            self.check_train()
            return
        super().check()

    def check_train(self) -> None:
        """The `TrainConfig` rules alone (DPO's own rule on label_smoothing does not apply)."""
        super(DPOConfig, self).check()


SCORE_HEAD = "score"  # the scalar head's module name, as transformers' *ForSequenceClassification names it
REWARD_BATCH = 16  # rows a reward model scores at once in GRPO (`rewards=model:DIR`; the memory plan's too)


@dataclass
class RewardConfig(TrainConfig):
    """A reward-model run: a scalar head on any decoder family, trained on preference pairs with the
    Bradley-Terry loss (names and defaults as TRL's RewardConfig)."""

    center_rewards_coefficient: float | None = doc(None, "add this x the mean of (chosen reward + rejected reward)^2 "
                                                         "(Eisenstein et al. 2023: rewards centred on 0); none: off",
                                                   ge=0, example=0.01)
    drop_identical_pairs: bool = doc(False, "drop pairs whose chosen and rejected are the same tokens (counted); "
                                            "else such a pair is an error naming its line")
    shared_prompt: bool = shared_prompt_key()

    def check(self) -> None:
        super().check()
        if self.parallel == "fsdp":
            raise UserError("parallel=fsdp: a reward model's new scalar head is not sharded yet — use parallel=ddp")
        if self.finetune == "lora" and SCORE_HEAD not in self.modules_to_save:
            # the head is new (random): with LoRA it trains whole, as peft's SEQ_CLS task adds it
            self.modules_to_save = [*self.modules_to_save, SCORE_HEAD]


@dataclass
class GRPOConfig(TrainConfig):
    """A GRPO run: `TrainConfig` plus generation and loss keys (names and defaults as TRL's GRPOConfig).

    `batch_size` counts prompts per micro-batch; each gets `num_generations` completions."""

    rewards: str = doc("", "reward functions: path/to/file.py:fn[,fn2...] (TRL's signature fn(prompts, "
                           "completions, **columns) -> list of float | None); model:DIR: a reward model's folder "
                           "(recipes/reward_model.py finetune=full: out/model, or its merged adapter); empty: the "
                           "recipe's own")
    reward_weights: list[float] = doc([], "one weight per reward function (empty: all 1)")
    num_generations: int = doc(8, "completions sampled per prompt (the group)", ge=2)
    max_completion_length: int = doc(256, "new tokens per completion at most", ge=1)
    temperature: float = doc(1.0, "sampling temperature (the log-probs are of logits / temperature, as TRL)", gt=0)
    top_p: float = doc(1.0, "nucleus sampling: keep the smallest set of tokens of probability >= top_p", gt=0, le=1)
    top_k: int = doc(0, "sample among the k most likely tokens only (0: all)", ge=0)
    loss_type: str = doc("dapo", "TRL's loss_type: how the ratio enters (clipped: dapo, grpo, bnpo, dr_grpo, luspo; "
                                 "cispo, sapo, vespo) and how token losses are averaged; rloo: TRL's RLOOTrainer "
                                 "(leave-one-out advantages, the KL in the reward, the clipped sequence ratio)",
                         choices=(*GRPO_LOSS_TYPES, "rloo"))
    scale_rewards: str = doc("group", "advantages divided by the group's std, the batch's, or not at all",
                             choices=SCALE_REWARDS)
    normalize_advantages: bool = doc(False, "loss_type=rloo: the advantages less their mean, over their std "
                                            "(over the whole batch)")
    epsilon: float = doc(0.2, "lower clip of the ratio: 1 - epsilon", gt=0, lt=1)
    epsilon_high: float = doc(0.0, "upper clip of the ratio: 1 + epsilon_high (0: epsilon); cispo: the cap of "
                                   "the ratio itself (ScaleRL recommends 5.0)", ge=0)
    importance_sampling_level: str = doc("token", "the importance ratio per token, or per sequence (GSPO: the mean "
                                                  "log-ratio of the completion)", choices=("token", "sequence"))
    delta: float | None = doc(None, "two-sided clipping: cap the unclipped ratio at delta too (clipped losses; "
                                    "none: off)", gt=1)
    sapo_temperature_pos: float = doc(1.0, "sapo: the gate's temperature for positive advantages", gt=0)
    sapo_temperature_neg: float = doc(1.05, "sapo: the gate's temperature for non-positive advantages", gt=0)
    vespo_k_pos: float = doc(2.0, "vespo: the gamma weight's power for non-negative advantages")
    vespo_lambda_pos: float = doc(3.0, "vespo: the gamma weight's decay for non-negative advantages")
    vespo_k_neg: float = doc(3.0, "vespo: the gamma weight's power for negative advantages")
    vespo_lambda_neg: float = doc(2.0, "vespo: the gamma weight's decay for negative advantages")
    beta: float = doc(0.0, "weight of the KL term against the reference (0: no reference is run)", ge=0)
    use_bias_correction_kl: bool = doc(True, "multiply the KL term by the ratio (TRL's default: an unbiased "
                                             "reverse-KL gradient)")
    num_iterations: int = doc(1, "optimizer steps on each generation (old log-probs kept from the first)", ge=1)
    mask_truncated_completions: bool = doc(False, "completions cut at max_completion_length take no loss")
    log_completions_every: int = doc(10, "write a sample of prompts, completions and rewards to "
                                         "out/completions.jsonl every this many steps (0: never)", ge=0)
    tools: str = doc("", "functions the model may call during the rollout: path/to/file.py:fn[,fn2...] "
                         "(or names of the recipe's own); offered through the chat template, results masked "
                         "from the loss")
    environment: str = doc("", "path/to/file.py:Class, one instance per rollout (TRL's environment_factory): "
                               "its public methods are tools, reset(**row) may extend the prompt, get_reward() "
                               "scores the rollout")
    max_tool_calls: int = doc(5, "rounds of tool calls per completion at most (TRL's "
                                 "max_tool_calling_iterations)", ge=0)
    tool_timeout: float = doc(10.0, "seconds a tool call may run before it is stopped (its result: an error)", gt=0)

    def check(self) -> None:
        super().check()
        if self.max_len <= self.max_completion_length:
            raise UserError(f"max_len={self.max_len}: must exceed max_completion_length={self.max_completion_length} "
                            f"(max_len counts prompt + completion) — raise max_len")
        if self.parallel == "fsdp":
            raise UserError("parallel=fsdp: GRPO samples with the whole model on each rank — use parallel=ddp")
        if self.loss_type == "rloo" and self.scale_rewards != "group":
            raise UserError(f"scale_rewards={self.scale_rewards}: loss_type=rloo's advantages are leave-one-out, not "
                            f"scaled by a std — drop scale_rewards, or use normalize_advantages=true")
        if self.normalize_advantages and self.loss_type != "rloo":
            raise UserError(f"normalize_advantages=true: belongs to loss_type=rloo — use scale_rewards with "
                            f"loss_type={self.loss_type}")
        if self.beta and self.finetune == "full":
            raise UserError(f"beta={self.beta}: the reference is the model with its adapter switched off, which "
                            f"finetune=full has none of — use finetune=lora, or beta=0")


@dataclass
class DistillConfig(TrainConfig):
    """A distillation run: `TrainConfig` (the student is `model`) plus the teacher and the KD mix."""

    teacher: str = doc("", "HF-format teacher model folder (same tokenizer as the student)")
    teacher_quantize: str = doc("none", "quantize the teacher's linears as they load (nf4, int8: bitsandbytes)",
                                choices=("none", "nf4", "int8"))
    temperature: float = doc(2.0, "softening temperature T of both distributions (the KL is scaled by T^2)", gt=0)
    kd_weight: float = doc(0.5, "weight of the KD term (per target token)", ge=0)
    ce_weight: float = doc(0.5, "weight of the student's cross-entropy on the labels (per target token)", ge=0)
    top_k: int = doc(0, "subset KD over the teacher's top-k tokens per position (0: the full vocabulary)", ge=0)
    feature_weight: float = doc(0.0, "weight of feature matching on the mapped layers' hidden states (per target "
                                     "token)", ge=0)
    feature_loss: str = doc("mse", "feature distance: mse (mean over the teacher's width) or cosine (1 - cos)",
                            choices=("mse", "cosine"))
    feature_layers: list[int] = doc([], "student layers whose hidden states are matched (negative: from the end; "
                                        "empty: every layer)")
    attention_weight: float = doc(0.0, "weight of attention transfer, KL(teacher || student) of the mapped "
                                       "layers' attention distributions (per target token)", ge=0)
    attention_layers: list[int] = doc([-1], "student layers whose attention is transferred (only these write "
                                            "their attention out)")
    layer_map: list[str] = doc([], "student:teacher layer pairs overriding the uniform rule (teacher layer "
                                   "ceil((i+1)*Lt/Ls)-1 for student layer i), e.g. 0:1,1:3")
    balance_steps: int = doc(20, "after this many steps, say once if a term's share of the loss is off its "
                                 "weight's share by more than balance_factor (0: no check)", ge=0)
    balance_factor: float = doc(4.0, "how far (x or 1/x) a term's share may be from its weight's share before "
                                     "it is reported", gt=1)

    def check(self) -> None:
        super().check()
        if not any(getattr(self, f"{t}_weight") > 0 for t in TERMS):
            raise UserError("kd_weight, ce_weight, feature_weight and attention_weight are all 0: the loss would be "
                            "zero — give at least one a positive weight, e.g. kd_weight=0.5 ce_weight=0.5")
        if not self.teacher:
            raise UserError("teacher: not set — pass teacher=path/to/hf_teacher_folder (same tokenizer as model=)")
