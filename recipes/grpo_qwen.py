"""GRPO on a Qwen (or any decoder) checkpoint with a LoRA adapter: online RL from rewards a program checks.

    python -m minitrain recipes/grpo_qwen.py                      # the built-in demo (CPU, about a minute)
    python -m minitrain recipes/grpo_qwen.py model=/path/to/Qwen3-0.6B data=math.jsonl \\
        rewards=checks.py:correct,formatted reward_weights=1,0.2 out=runs/grpo   # 12 GB GPU

Rows are `{"prompt": str | [messages]}` plus any other columns (any file format of docs/data.md,
`fields=` to rename); a conversation is rendered with the checkpoint's chat template and its
generation prompt. Each step takes `batch_size` prompts per micro-batch and samples
`num_generations` completions of each with the adapter on (temperature, top_p, top_k,
`max_completion_length`; a completion ends at eos or the template's end-of-turn token), through
the model's own KV cache. The reward functions are plain Python with TRL's signature,

    def correct(prompts, completions, answer, **kw) -> list[float | None]: ...

(`answer`: a column of the rows; None: the function does not apply to that row), from
`rewards=file.py:fn[,fn2]`, or the recipe's own (`REWARDS` below), weighted by `reward_weights`.
The loss is TRL's GRPO (`minitrain.objectives.grpo`): `loss_type` dapo (TRL's default) | grpo |
bnpo | dr_grpo | ..., or `rloo` (TRL's RLOO: leave-one-out advantages, `normalize_advantages`, the KL
in the reward; `minitrain.objectives.rloo`), `scale_rewards` group | batch | none, `epsilon` / `epsilon_high`,
`num_iterations`, `mask_truncated_completions`, and `beta` > 0 for a KL term against the reference:
the model with its adapter off, or, with `init_adapter=`, a frozen copy of that adapter (never a
second model). metrics.jsonl has TRL's names (`reward`, `reward_std`, `rewards/<fn>/mean`,
`frac_reward_zero_std`, `completions/mean_length`, `completions/clipped_ratio`, `kl`,
`clip_ratio/...`, `entropy`); out/completions.jsonl a sample of prompts, completions and rewards
every `log_completions_every` steps; with `eval_data`, `eval/reward` is the held-out reward of the
greedy completions, before step 1 and every `eval_every` steps (also in out/eval.jsonl).

Tools and environments (docs/grpo.md): `tools=calc.py:add,multiply` offers plain Python functions to
the model through the chat template; its calls (Qwen, LLaMA 3, Mistral, harmony formats) run during
the rollout, their results go back as tool messages, masked from the loss, up to `max_tool_calls`
rounds, each call stopped after `tool_timeout` seconds; `environment=game.py:Game` is TRL's
environment_factory (one instance per rollout: `reset(**row)`, its public methods as tools,
`get_reward()` as a reward). Metrics `tools/call_frequency`, `tools/failure_frequency`.

Image prompts (a vision-language folder: Qwen2.5-VL, Qwen3-VL, Gemma 3): a conversation prompt with TRL's image
parts `{"type": "image", "image": "img.png"}` or an `images` column (paths read from the data file's folder). The
sampler prefills each prompt with its images, and every forward of prompt + completion (policy, reference, old
log-probs) carries them; the reward functions get the prompt as written and the `images` column as paths. Not
with tools or an environment yet (refused).

Under torchrun (parallel=ddp) each rank samples the completions of its own prompts: a group never
spans ranks, and `scale_rewards=batch` divides by the std of the whole batch (every rank's rewards).

The built-in demo (no model, data or eval_data on the command line) trains demo/grpo/ (written by
tools/make_grpo_demo.py): a tiny LLaMA asked for the last digit of a sum, which answers carelessly
(held-out reward about 0.1) and only sometimes works it out; GRPO makes it work it out.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import models
from minitrain import checkpoint as ckpt
from minitrain.parallel import distributed
from minitrain.bundled import demo_dir
from minitrain.errors import UserError
from minitrain.objectives.agent import Agent
from minitrain.objectives.configs import GRPOConfig
from minitrain.objectives.environments import Environments, load_environment
from minitrain.objectives.grpo import GRPOObjective, collate_prompts
from minitrain.objectives.reference import make_reference
from minitrain.objectives.rewards import load_rewards
from minitrain.objectives.tools import ToolKit, json_schema, load_tools
from minitrain.progress import log, strict_json
from minitrain.run import (Job, attach_adapters, check_out_dir, finish, load_image_examples, load_model,
                           load_tokenizer, prepare_out_dir, rows_have_images, with_images)
from minitrain.train import train

DEMO = demo_dir() / "grpo"  # demo/grpo in a clone, minitrain/demo/grpo in an installed wheel
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def last_digit(prompts, completions, answer, **_) -> list[float]:
    """1 when the last digit written in the completion is the row's `answer`, else 0 (the demo's reward)."""
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else c[-1]["content"]
        digits = re.findall(r"\d", text)
        out.append(1.0 if digits and digits[-1] == str(a) else 0.0)
    return out


REWARDS = {"last_digit": last_digit}  # the recipe's own reward functions: rewards=last_digit names one
TOOLS: dict = {}  # the recipe's own tools: tools=fn names one (a function with type hints and an Args: docstring)

config = GRPOConfig(  # a real run: model=, data= and rewards= are asked for
    out="runs/grpo_qwen",
    max_steps=-1,
    epochs=1.0,
    batch_size=2,
    grad_accum=4,
    lr=1e-5,
    warmup=0.05,
    schedule="constant",
    max_len=1280,
    log_every=1,
    lora_r=16,
    lora_alpha=32.0,
    lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    checkpointing=True,
    num_generations=8,
    max_completion_length=256,
    eval_every=50,
)

# the built-in demo: used only when the command names none of model / data / eval_data
demo = dict(
    model=str(DEMO / "model"),
    data=str(DEMO / "train.jsonl"),
    eval_data=str(DEMO / "eval.jsonl"),
    rewards="last_digit",
    max_steps=30,
    batch_size=8,
    grad_accum=1,
    lr=2e-3,
    schedule="constant",
    warmup=0.0,
    max_len=48,
    num_generations=8,
    max_completion_length=16,
    eval_every=10,
    log_completions_every=10,
    lora_r=8,
    lora_alpha=16.0,
    checkpointing=False,
)


def eos_ids(tok, model) -> list[int]:
    """The ids that end a completion: the tokenizer's eos, the config's (an int or a list), end-of-turn tokens."""
    ids = {tok.eos_id} if tok.eos_id is not None else set()
    cfg_eos = getattr(model.config, "eos_token_id", None)
    ids |= set(cfg_eos if isinstance(cfg_eos, (list, tuple)) else [cfg_eos] if cfg_eos is not None else [])
    ids |= {i for t in END_OF_TURN if (i := tok.special_id(t)) is not None}
    return sorted(ids)


def setup(config: GRPOConfig) -> Job:
    """Load the model, attach the adapter, read the prompts and the reward functions; writes nothing."""
    tools = load_tools(config.tools, TOOLS)  # bad tool / environment / reward files fail in a second
    envs = Environments(load_environment(config.environment)) if config.environment else None
    env_reward = envs.reward() if envs else None
    if envs and not env_reward and not config.rewards:
        raise UserError(f"environment={config.environment}: {envs.name} has no get_reward method and rewards= is not "
                        f"set — define get_reward(self) -> float (it scores the finished rollout), or pass rewards=")
    if env_reward and not config.rewards:
        rewards = []  # the environment owns the reward
    else:
        rewards = load_rewards(config.rewards, REWARDS, models.from_hf_config, config.device,  # model:DIR loads
                               config.precision)  # its weights later
    if env_reward:
        rewards.append(env_reward)
    schemas = [json_schema(fn) for _, fn in tools] + (envs.schemas if envs else [])
    names = [s["function"]["name"] for s in schemas]
    if len(set(names)) != len(names):
        raise UserError(f"tools: two tools are named {sorted(n for n in names if names.count(n) > 1)[0]!r} (tools= and "
                        f"the environment's methods) — rename one")
    tok = load_tokenizer(config)
    # a vision-language checkpoint reads the prompts' images; the sampler prefills each prompt with them
    train_examples, eval_examples, images = load_image_examples(
        config, tok, "prompts", tools=schemas or None, max_prompt_len=config.max_len - config.max_completion_length)
    ex = next((ex for part in (train_examples, eval_examples or []) for ex in part if ex.get("images")), None)
    if ex is not None and (schemas or envs):
        raise UserError(f"{ex['row']}: a prompt with images — tools and environments continue a rollout after its "
                        f"prompt, which carries no images yet; drop tools= / environment= or the images")
    ex = next((ex for part in (train_examples, eval_examples or []) for ex in part
               if not isinstance(ex["prompt"], list)), None) if schemas else None
    if ex is not None:
        raise UserError(f"{ex['row']}: a string prompt — tools are offered through the chat template, so the rows "
                        f"need conversation prompts ({{\"prompt\": [{{\"role\": \"user\", \"content\": ...}}]}})")
    model, tok = load_model(config, models.from_hf_config, tok)
    if model.is_encoder_decoder:
        raise UserError(f"{config.model}: is an encoder-decoder (T5) model — GRPO here trains causal LMs")
    lora = attach_adapters(model, config, train_towers=rows_have_images(images, train_examples))
    reference = make_reference(model, config.init_adapter) if config.beta else None
    ends = eos_ids(tok, model)
    agent = None
    if schemas or envs:
        kit = ToolKit(tok, tools, max_rounds=config.max_tool_calls, timeout=config.tool_timeout,
                      max_completion_length=config.max_completion_length,
                      max_positions=getattr(model.config, "max_position_embeddings", None),
                      schemas=[json_schema(fn) for _, fn in tools], parse=bool(schemas))
        agent = Agent(kit, envs)
        ends = sorted(set(ends) | set(kit.stop_ids()))  # a turn that ends on a call (gpt-oss <|call|>) stops too
        log(f"grpo: tools {', '.join(names)} ({kit.format} calls, up to {config.max_tool_calls} rounds, "
            f"{config.tool_timeout:g} s each)" + (f"; environment {envs.name}, one per rollout" if envs else ""))
    log(f"grpo: loss {config.loss_type}, {config.num_generations} completions per prompt of up to "
        f"{config.max_completion_length} tokens (temperature {config.temperature}, top_p {config.top_p}, "
        f"top_k {config.top_k or 'off'}), ending at ids {ends}; rewards "
        + ", ".join(f"{n} x {w:g}" for (n, _), w in zip(rewards, config.reward_weights or [1.0] * len(rewards)))
        + (f"; beta={config.beta}, reference = " + ("init_adapter snapshot" if config.init_adapter else
                                                    "base model (adapter disabled)") if config.beta else "; no KL"))
    objective = GRPOObjective(config, rewards, tok, models.family(model).KVCache, ends, reference,
                              out=Path(config.out), log=log, agent=agent)
    if not eval_examples:
        log("note: no eval_data — no held-out reward (pass eval_data=prompts.jsonl for eval/reward)")
    collate = functools.partial(collate_prompts, pad_id=tok.pad_id)  # each prompt's images also in its G rows:
    return Job(model, objective, train_examples, with_images(collate, images, group=config.num_generations),
               eval_examples, lora, tok, images)


def run(config: GRPOConfig) -> dict:
    """Train the adapter with GRPO and save it; returns the loop's summary plus the held-out reward."""
    check_out_dir(config)
    job = setup(config)
    out = prepare_out_dir(config, job)

    def record(model, step: int, row: dict) -> dict:
        distributed.main_only(lambda: _append(out / "eval.jsonl", {"step": step, "eval/reward": row["eval/reward"]}))
        return {}

    if config.resume:
        step = ckpt.read_state(out)["step"]
        job.objective.start_at(step)
        for name in ("eval.jsonl", "completions.jsonl"):
            distributed.main_only(lambda name=name: ckpt.truncate_log(out / name, step))
    else:
        for name in ("eval.jsonl", "completions.jsonl"):
            distributed.main_only(lambda name=name: (out / name).unlink(missing_ok=True))
        if job.eval_examples:
            m = job.objective.evaluate(job.model, job.eval_examples, job.collate, config.batch_size)
            log(f"step 0: eval/reward {m['eval/reward']:.4f}")
            record(job.model, 0, m)
    summary = train(job.model, job.objective, job.train_examples, job.collate, config,
                    eval_examples=job.eval_examples, eval_fn=record if job.eval_examples else None)
    folder = finish(job.model, config, job.lora, summary)
    log(f"GRPO {'adapter' if job.lora else 'model'}: {folder}"
        + (f" | held-out reward {summary['eval/reward']:.3f}" if "eval/reward" in summary else ""))
    return summary


def _append(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(strict_json(row) + "\n")
