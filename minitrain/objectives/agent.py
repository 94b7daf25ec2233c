"""The rollout of an agent: G completions per prompt that call tools and act in an environment.

    agent_rollout(model, batch, G, agent=Agent(toolkit, environments), sampling=...) -> AgentRollout

What GRPO's rollout becomes with `tools=` or `environment=` (TRL's `_generate_and_score_completions`
with `tools` / `environment_factory`): each rollout draws its own environment instance, whose
`reset(**row)` may extend its prompt (re-rendered then by the chat template, with the tool schemas);
the completions are sampled (`minitrain.objectives.sampling.sample`: one prefill per prompt when the
G prompts of a group are equal, one row each when an environment made them differ); their tool calls
run and generation resumes after the results (`minitrain.objectives.tools.ToolKit.run`), each resumed
row one prefill of its whole context, as TRL's. The result is padded as `sample`'s: prompts left,
completions right, with `tool_mask` beside `mask` (0 on the tool turns' tokens) and `truncated`
as TRL decides it (the last token is no eos).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from minitrain.errors import UserError
from minitrain.objectives.environments import Environments
from minitrain.objectives.sampling import Completions, sample
from minitrain.objectives.tools import ToolKit


@dataclass
class Agent:
    """What the rollout may call: the toolkit (tools offered to every rollout, the parser, the limits)
    and the environment class's pool (None without environment=)."""

    toolkit: ToolKit
    environments: Environments | None = None

    @property
    def schemas(self) -> list[dict]:
        return self.toolkit.schemas + (self.environments.schemas if self.environments else [])


@dataclass
class AgentRollout:
    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor
    completions: Completions  # ids / mask (N, C) right-padded, truncated (N,)
    tool_mask: torch.Tensor  # (N, C) 0 on tool-turn tokens, 1 elsewhere (padding included, as TRL pads it)
    calls: int = 0
    failures: int = 0
    instances: list | None = None
    messages: list = field(default_factory=list)


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), P), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, P - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, P - len(r):] = 1
    return ids, mask


def right_pad(rows: list[list[int]], value: int) -> torch.Tensor:
    C = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), C), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]


def agent_rollout(model: nn.Module, batch: dict[str, Any], G: int, agent: Agent, *, tok: Any, new_cache: Any,
                  max_new_tokens: int, eos_ids: list[int], greedy: bool = False, **sampling: Any) -> AgentRollout:
    """G completions of each of the batch's prompts, with the agent's tool rounds (see the module doc).

    batch: `collate_prompts`' (prompt_ids, prompt_attention_mask, prompts, columns); sampling: sample()'s
    temperature / top_k / top_p."""
    device = batch["prompt_ids"].device
    pad = tok.pad_id
    B = batch["prompt_ids"].shape[0]
    N = B * G
    base = _rows(batch["prompt_ids"], batch["prompt_attention_mask"])
    prompts = [list(base[i // G]) for i in range(N)]
    instances, toolsets = None, None
    envs = agent.environments
    if envs is not None:
        instances = envs.draw(N)
        names = list(batch["columns"])
        rows = [{"prompt": batch["prompts"][i // G], **{k: batch["columns"][k][i // G] for k in names}}
                for i in range(N)]
        for i, text in enumerate(envs.reset(instances, rows)):
            if text is None:
                continue
            prompt = batch["prompts"][i // G]
            if not isinstance(prompt, list):
                raise UserError(f"environment={envs.name}: reset returned text for {batch['rows'][i // G]}, whose "
                                f"prompt is a string — give conversation prompts ([{{\"role\": \"user\", ...}}]), "
                                f"as TRL needs")
            last = prompt[-1]
            grown = prompt[:-1] + [{**last, "content": last["content"] + text}]
            prompts[i] = tok.encode_chat(grown, add_generation_prompt=True, tools=agent.schemas)[0]
        toolsets = [{**agent.toolkit.tools, **envs.toolset(e)} for e in instances]

    def generate(contexts: list[list[int]], budgets: list[int], group: int = 1) -> list[list[int]]:
        """Each context's continuation (`group` of them per context, consecutive), at most its budget long."""
        todo = [i for i, b in enumerate(budgets) if b > 0]
        out: list[list[int]] = [[] for _ in range(len(contexts) * group)]
        if not todo:
            return out
        ids, mask = left_pad([contexts[i] for i in todo], pad)
        comp = sample(model, ids.to(device), mask.to(device), new_cache=new_cache, num_generations=group,
                      max_new_tokens=max(budgets[i] for i in todo), greedy=greedy, eos_ids=eos_ids, pad_id=pad,
                      **sampling)
        rows = _rows(comp.ids, comp.mask)
        for k, i in enumerate(todo):
            for j in range(group):
                out[i * group + j] = rows[k * group + j][: budgets[i]]
        return out

    if all(prompts[i] == prompts[i - i % G] for i in range(N)):  # one prefill per prompt, its cache repeated G times
        first = generate(prompts[::G], [max_new_tokens] * B, group=G)
    else:  # an environment's reset made a group's prompts differ: one row each
        first = generate(prompts, [max_new_tokens] * N)
    turns = agent.toolkit.run(prompts, first, generate, toolsets)
    prompt_ids, prompt_mask = left_pad(prompts, pad)
    ids = right_pad(turns.ids, pad)
    mask = right_pad([[1] * len(r) for r in turns.ids], 0)
    tool_mask = right_pad(turns.tool_mask, 1)
    ends = set(eos_ids) | {pad}
    truncated = torch.tensor([not r or r[-1] not in ends for r in turns.ids])
    return AgentRollout(prompt_ids.to(device), prompt_mask.to(device), Completions(ids.to(device), mask.to(device),
                        truncated.to(device)), tool_mask.to(device), turns.calls, turns.failures, instances,
                        turns.messages)



def completion_messages(tok: Any, ids: list[int], tool_mask: list[int], rounds: list[list[dict]]) -> list[dict]:
    """A rollout as TRL hands it to reward functions: an assistant message per stretch of the model's
    tokens, each round's tool messages in place of its tool turn."""
    out: list[dict] = []
    k, at = 0, 0
    for model_tokens, run in itertools.groupby(tool_mask):
        n = len(list(run))
        if model_tokens:
            out.append({"role": "assistant", "content": tok.decode(ids[at : at + n])})
        elif k < len(rounds):
            out += rounds[k]
            k += 1
        at += n
    return out or [{"role": "assistant", "content": ""}]
