"""Tools and environments in GRPO's rollout (`minitrain.objectives.tools`, `environments`, `agent`).

- the schema builder equals `transformers.utils.get_json_schema` on functions of every supported shape;
  a prompt rendered with tools equals transformers' `apply_chat_template(tools=...)`;
- each family's call format is parsed (Qwen / Hermes, LLaMA 3, Mistral both forms, harmony);
- untrusted model output, planted in fixed completions: an unknown tool, malformed JSON, wrong or
  non-object arguments, a tool that raises, returns an unprintable value, runs past tool_timeout, or
  calls sys.exit — each becomes an error tool message and a counted failure; nothing is evaluated;
- against TRL 1.x's GRPOTrainer with the same `tools` (and with an `environment_factory`) on the same
  fixed model output with calls: prompt and completion ids, the tool mask, rewards, advantages,
  the tool metrics, the loss and every gradient, to 1e-5;
- from the command line: tools= and environment= train; a user's mistake is one line, exit 2.
"""

from __future__ import annotations

import collections
import enum
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Literal, Optional

import pytest
import torch

import models
from minitrain.objectives import agent as agent_module
from minitrain.objectives.sampling import Completions
from minitrain.objectives.tools import Call, ToolKit, json_schema, parse_calls, run_call
from minitrain.weights import load_pretrained

RECIPE = str(Path(__file__).resolve().parent.parent / "recipes" / "grpo_qwen.py")
MAX_COMPLETION = 400
MAX_POSITIONS = 2048  # the tool schemas make the prompts ~700 tokens of the tiny vocabulary
TEMPERATURE = 0.8


# ----------------------------------------------------------------------------- the tools of the tests


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum.
    """
    return a + b


def fail(x: str) -> str:
    """A tool that always raises.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"cannot handle {x}")


class Unprintable:
    def __str__(self):
        raise ValueError("no text for this")


def weird(n: int) -> object:
    """Returns something str() cannot print.

    Args:
        n: Ignored.
    """
    return Unprintable()


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def leave(code: int) -> None:
    """Calls sys.exit.

    Args:
        code: The exit code.
    """
    sys.exit(code)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def every_shape(name: str, n: int, x: float, flag: bool, items: list[int], pairs: dict[str, float],
                maybe: Optional[int], either: int | str, mode: Literal["a", "b"], color: Color,
                point: tuple[int, float], drink: str = "tea", untyped_list: list = None) -> dict[str, int]:
    """Every hint the schema builder knows.

    More text on a second line.

    Args:
        name: A name.
        n: A count,
            on two lines.
        x: A number.
        flag: A switch.
        items: Some integers.
        pairs: A mapping.
        maybe: Perhaps an integer.
        either: One or the other.
        mode: The mode.
        color: A color.
        point: A pair.
        drink: What to drink (choices: ["tea", "coffee"])
        untyped_list: A list.

    Returns:
        Counts by name.
    """


class Counter:
    """A TRL-style environment: its public methods are tools."""

    def __init__(self):
        self.total = 0

    def reset(self, **kwargs) -> str | None:
        self.total = 0
        return " (start at 0)"

    def bump(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much.
        """
        self.total += by
        return f"total {self.total}"

    def get_reward(self) -> float:
        return float(self.total)

    def _private(self):
        return None


def test_schema_equals_transformers():
    from transformers.utils import get_json_schema

    for fn in (add, fail, weird, slow, every_shape, Counter().bump):
        assert json_schema(fn) == get_json_schema(fn), fn


def test_functions_without_a_schema_are_one_line():
    from minitrain.errors import UserError

    def no_doc(a: int):
        return a

    def no_hint(a):
        """Doc.

        Args:
            a: A.
        """

    def undocumented(a: int, b: int):
        """Doc.

        Args:
            a: A.
        """

    for fn, what in ((no_doc, "has no docstring"), (no_hint, "'a' has no type hint"),
                     (undocumented, "'b' has no description")):
        with pytest.raises(UserError, match=what):
            json_schema(fn)


def test_each_familys_call_format_is_parsed():
    q = 'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n' \
        '<tool_call>\n{"name": "fail", "arguments": {"x": "y"}}\n</tool_call><|im_end|>'
    assert [(c.name, c.arguments) for c in parse_calls(q, "hermes")] == [("add", {"a": 2, "b": 3}), ("fail", {"x": "y"})]
    assert parse_calls("no call here<|im_end|>", "hermes") == []
    ll = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>'
    assert [(c.name, c.arguments) for c in parse_calls(ll, "llama3")] == [("add", {"a": 1, "b": 2})]
    assert parse_calls("The answer is {x}.<|eot_id|>", "llama3") == []
    m1 = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]</s>'
    m2 = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}</s>'
    for m in (m1, m2):
        assert [(c.name, c.arguments) for c in parse_calls(m, "mistral")] == [("add", {"a": 1, "b": 2})]
    h1 = '<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary to=functions.add ' \
         '<|constrain|>json<|message|>{"a": 4, "b": 5}<|call|>'
    h2 = 'to=functions.add<|channel|>commentary json<|message|>{"a": 4, "b": 5}<|call|>'  # TRL's gpt-oss schema
    for h in (h1, h2):
        assert [(c.name, c.arguments) for c in parse_calls(h, "harmony")] == [("add", {"a": 4, "b": 5})]
    bad = parse_calls('<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>', "hermes")
    assert len(bad) == 1 and bad[0].error and "not valid JSON" in bad[0].error


def test_untrusted_calls_become_error_messages():
    """Each planted call is answered by a tool message; only a well-formed call to an offered function
    runs; the failures are counted. Nothing the model writes is evaluated."""
    tools = {"add": add, "fail": fail, "weird": weird, "slow": slow, "leave": leave}
    cases = [
        (Call("add", {"a": 2, "b": 3}), "5", False),
        (Call("__import__('os').system", {"command": "echo hi"}), "Tool __import__('os').system not found.", True),
        (Call("eval", {"source": "1+1"}), "Tool eval not found.", True),
        (parse_calls("<tool_call>{not json}</tool_call>", "hermes")[0], "not valid JSON", True),
        (Call("add", {"a": 2}), "wrong arguments for add", True),
        (Call("add", {"a": 2, "b": 3, "c": 4}), "wrong arguments for add", True),
        (Call("add", [2, 3]), "must be a JSON object", True),
        (Call("fail", {"x": "it"}), "cannot handle it", True),
        (Call("weird", {"n": 1}), "cannot be printed", True),
        (Call("slow", {"seconds": 30.0}), "ran past 0.2 s and was stopped", True),
        (Call("leave", {"code": 3}), "3", True),
    ]
    env = Counter()
    from minitrain.objectives.environments import Environments

    offered = Environments(Counter).toolset(env)
    assert set(offered) == {"bump"}  # not reset, get_reward, nor _private: the model cannot call them
    for name in ("reset", "get_reward", "_private", "__init__"):
        assert run_call(Call(name, {}), offered, timeout=1.0)[1] == str({"error": f"Tool {name} not found."})
    for call, expected, failed in cases:
        name, content, bad = run_call(call, tools, timeout=0.2)
        assert expected in content and bad == failed, (call, content)
        if failed:
            assert content.startswith("{'error': ")  # TRL's form: str({"error": str(e)})


# ----------------------------------------------------------------------------- a Qwen checkpoint with tools


@pytest.fixture(scope="module")
def qwen_tools(tmp_path_factory):
    """A tiny Qwen2 with a Qwen-shaped tokenizer and Qwen2.5's chat template (tools, <tool_call>)."""
    import trl

    from _tok import make_qwen_tokenizer
    from conftest import save_hf_causal

    d = tmp_path_factory.mktemp("qwen_tools") / "model"
    save_hf_causal(d, model_type="qwen2", vocab_size=320, num_key_value_heads=2, bos_token_id=None,
                   eos_token_id=None, pad_token_id=None, max_position_embeddings=MAX_POSITIONS)
    make_qwen_tokenizer(d)
    shutil.copy(Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja", d / "chat_template.jinja")
    return d


def test_prompts_with_tools_render_as_transformers(qwen_tools):
    import transformers

    from minitrain.text.tokenizer import Tokenizer

    hf = transformers.AutoTokenizer.from_pretrained(str(qwen_tools))
    ours = Tokenizer.from_folder(qwen_tools)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 3?"}]
    expected = hf.apply_chat_template(msgs, tools=[add, Counter().bump], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    assert ours.encode_chat(msgs, add_generation_prompt=True, tools=[json_schema(add), json_schema(Counter().bump)])[0] \
        == expected


# the fixed model output: what each generation call returns, in order (TRL and minitrain ask in the same order)
CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call><|im_end|>'
SCRIPT = [
    [CALL.format("add", '{"a": 2, "b": 3}'),  # row 0: one call, then an answer
     "I think it is 7.<|im_end|>",  # row 1: no call
     CALL.format("add", '{"a": 20, "b": 22}')[: -len("<|im_end|>")] + "\n" + CALL.format("nope", '{"q": 1}'),  # 2 calls
     CALL.format("fail", '{"x": "now"}')],  # row 3: a tool that raises
    ["The answer is 5.<|im_end|>",  # row 0 after its tool turn
     CALL.format("fail", '{"x": "boom"}'),  # row 2 calls again (round 2)
     "Sorry, I cannot read it.<|im_end|>"],  # row 3
    ["That is 42 and then some more words that run past the completion budget of the test"],  # row 2, cut
]


def scripted(tok_encode):
    """A generation stand-in: call k returns SCRIPT[k]'s ids, one row per context, cut to the budget."""
    calls = iter(SCRIPT)

    def next_rows(n: int, budget: int) -> list[list[int]]:
        rows = [tok_encode(t) for t in next(calls)]
        assert len(rows) == n, (len(rows), n)
        return [r[:budget] for r in rows]

    return next_rows


def trl_rollout_and_loss(qwen_tools, tmp_path, monkeypatch, tools=None, environment_factory=None, reward_funcs=None):
    """TRL's GRPOTrainer on the fixed output: (its inputs to the loss, loss, grads, metrics)."""
    import datasets
    import transformers
    import trl

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(qwen_tools))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(qwen_tools), dtype=torch.float32)
    hf.config.dropout = 0.0
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                          per_device_train_batch_size=4, num_generations=2, max_completion_length=MAX_COMPLETION,
                          temperature=TEMPERATURE, disable_tqdm=True, gradient_checkpointing=False,
                          max_tool_calling_iterations=2, loss_type="dapo", beta=0.0)
    rows = [{"prompt": [{"role": "user", "content": "What is 2 plus 3?"}], "answer": 5},
            {"prompt": [{"role": "user", "content": "And 20 and 22?"}], "answer": 42}]
    t = trl.GRPOTrainer(model=hf, reward_funcs=reward_funcs or [], args=args, processing_class=hf_tok,
                        train_dataset=datasets.Dataset.from_list(rows * 2), tools=tools,
                        environment_factory=environment_factory)
    t.model.train()
    script = scripted(lambda s: hf_tok(s, add_special_tokens=False)["input_ids"])
    monkeypatch.setattr(t, "_generate_single_turn", lambda prompt_ids, images, mm, num_generations, **kw:
                        (script(len(prompt_ids), MAX_COMPLETION), None))
    t._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    t.current_gradient_accumulation_steps = 1
    inputs = t._generate_and_score_completions([r for r in rows for _ in range(2)])
    metrics = {k: v[-1] for k, v in t._metrics["train"].items()}
    t.model.zero_grad(set_to_none=True)
    loss = t._compute_loss(t.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
    metrics.update({k: v[-1] for k, v in t._metrics["train"].items()})
    return inputs, float(loss), grads, metrics, rows


def ours_rollout_and_loss(qwen_tools, monkeypatch, rows, tools, environment=None, rewards=()):
    from minitrain.objectives.agent import Agent
    from minitrain.objectives.environments import Environments
    from minitrain.objectives.grpo import GRPOConfig, GRPOObjective, collate_prompts
    from minitrain.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(qwen_tools)
    envs = Environments(environment) if environment else None
    schemas = [json_schema(fn) for _, fn in tools] + (envs.schemas if envs else [])
    kit = ToolKit(tok, tools, max_rounds=2, timeout=5.0, max_completion_length=MAX_COMPLETION,
                  max_positions=MAX_POSITIONS)
    rewards = list(rewards) + ([envs.reward()] if envs and envs.has_reward else [])
    cfg = GRPOConfig(num_generations=2, max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE,
                     loss_type="dapo", grad_accum=1, max_tool_calls=2)
    eos = tok.special_id("<|im_end|>")
    objective = GRPOObjective(cfg, rewards, tok, new_cache=None, eos_ids=[eos], agent=Agent(kit, envs))
    script = scripted(tok.encode)

    def fake_sample(model, ids, mask, *, num_generations=1, max_new_tokens, **kw):
        out = script(ids.shape[0] * num_generations, max_new_tokens)
        lengths = [len(r) for r in out]
        C = max(lengths)
        padded = torch.tensor([r + [tok.pad_id] * (C - len(r)) for r in out])
        m = torch.tensor([[1] * n + [0] * (C - n) for n in lengths])
        return Completions(padded, m, torch.tensor([not r or r[-1] != eos for r in out]))

    monkeypatch.setattr(agent_module, "sample", fake_sample)
    examples = [{"prompt_ids": tok.encode_chat(r["prompt"], add_generation_prompt=True, tools=schemas)[0],
                 "prompt": r["prompt"], "columns": {"answer": r["answer"]}, "row": f"rows.jsonl:{i + 1}"}
                for i, r in enumerate(rows)]
    batch = collate_prompts(examples, tok.pad_id)
    model = load_pretrained(qwen_tools, models.from_hf_config)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    r = objective.rollout(model, batch)
    loss_sum, count, metrics = objective.loss(model, r)
    (loss_sum / count).backward()
    return r, float(loss_sum / count), {n: p.grad for n, p in model.named_parameters()}, metrics


def _unpad_left(ids, mask):
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def _assert_equal_to_trl(expected, ours):
    inputs, loss, grads, metrics, _ = expected
    r, our_loss, our_grads, our_metrics = ours
    assert _unpad_left(r["prompt_ids"], r["prompt_mask"]) == _unpad_left(inputs["prompt_ids"], inputs["prompt_mask"])
    C = inputs["completion_ids"].shape[1]
    assert r["completion_ids"].shape[1] == C
    assert torch.equal(r["completion_mask"], inputs["completion_mask"])
    keep = inputs["completion_mask"].bool()
    assert torch.equal(r["completion_ids"][keep], inputs["completion_ids"][keep])
    assert torch.equal(r["loss_mask"], inputs["completion_mask"] * inputs["tool_mask"])
    torch.testing.assert_close(r["advantages"], inputs["advantages"], atol=1e-5, rtol=1e-5)
    assert our_loss == pytest.approx(loss, abs=1e-5, rel=1e-5)
    assert grads and set(grads) <= set(our_grads)
    for n, ref in grads.items():
        torch.testing.assert_close(our_grads[n], ref, atol=1e-5, rtol=1e-4, msg=n)
    for k in ("tools/call_frequency", "tools/failure_frequency", "completions/mean_length",
              "completions/clipped_ratio", "entropy", "reward", "frac_reward_zero_std"):
        assert our_metrics[k] == pytest.approx(metrics[k], abs=1e-5, rel=1e-5), k


def _length_reward(completions, completion_ids, **kw):
    """A reward of the fixed output's shape: the completion's length mod 7 (equal on both sides by ids)."""
    return [float(len(c) % 7) for c in completion_ids]


def test_tool_rollout_and_loss_equal_trl(qwen_tools, tmp_path, monkeypatch):
    """The fixed output holds a call answered, a turn with no call, two calls in one turn (one to an
    unknown tool) followed by a second round that raises and then a reply cut at the budget, and a
    call that raises: the ids, the tool mask, rewards, advantages, tool metrics, loss and gradients
    equal TRL's. (A malformed call is an error message here; TRL's parser drops it: not compared.)"""
    expected = trl_rollout_and_loss(qwen_tools, tmp_path, monkeypatch, tools=[add, fail],
                                    reward_funcs=[_length_reward])
    inputs = expected[0]
    assert int((inputs["tool_mask"] == 0).sum()) > 0  # tool turns are in the completions, masked
    ours = ours_rollout_and_loss(qwen_tools, monkeypatch, expected[4], [("add", add), ("fail", fail)],
                                 rewards=[("_length_reward", _length_reward)])
    _assert_equal_to_trl(expected, ours)
    r = ours[0]
    assert r["metrics"]["tools/call_frequency"] == pytest.approx(5 / 4)  # add; add + nope, fail; fail
    assert r["metrics"]["tools/failure_frequency"] == pytest.approx(3 / 5)


def test_environment_rollout_and_reward_equal_trl(qwen_tools, tmp_path, monkeypatch):
    """A TRL environment class, unchanged: reset's text appended to the prompt, its method the tool,
    get_reward the reward (logged under the class name, beside a rewards= function): equal to TRL's
    environment_factory on the same fixed output."""
    global SCRIPT
    saved = SCRIPT
    SCRIPT = [[CALL.format("bump", '{"by": 2}'), "No.<|im_end|>", CALL.format("bump", '{"by": 5}'),
               CALL.format("bump", '{"by": "x"}')],
              ["Done.<|im_end|>", CALL.format("bump", '{"by": 1}'), "Hm.<|im_end|>"],
              ["Ok.<|im_end|>"]]
    try:
        expected = trl_rollout_and_loss(qwen_tools, tmp_path, monkeypatch, environment_factory=Counter,
                                        reward_funcs=[_length_reward])
        ours = ours_rollout_and_loss(qwen_tools, monkeypatch, expected[4], [], environment=Counter,
                                     rewards=[("_length_reward", _length_reward)])
    finally:
        SCRIPT = saved
    _assert_equal_to_trl(expected, ours)
    assert ours[3]["rewards/Counter/mean"] == pytest.approx(expected[3]["rewards/Counter/mean"])
    assert ours[3]["rewards/Counter/mean"] > 0


# ----------------------------------------------------------------------------- from the command line

TOOLS_FILE = '''
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def fail(x: str) -> str:
    """Always raises.

    Args:
        x: Anything.
    """
    raise RuntimeError("cannot handle " + x)


class _Unprintable:
    def __str__(self):
        raise ValueError("no text")


def weird(n: int) -> object:
    """Returns what str() cannot print.

    Args:
        n: Ignored.
    """
    return _Unprintable()


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


NOT_A_FUNCTION = 3


class Counter:
    made = 0

    def reset(self, **row):
        self.total = 0
        Counter.made += 1
        return " (" + str(Counter.made % 3) + ")"  # the G prompts of a group differ: one row each

    def bump(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much.
        """
        self.total += by
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total)


class NoReward:
    def reset(self, **row):
        return None


class NoReset:
    def get_reward(self) -> float:
        return 0.0
'''

REWARD_FILE = '''
def long(completions, **kw):
    return [float(len(c[-1]["content"]) % 3) for c in completions]
'''

# one planted first turn per rollout (4 prompts x G=2), each a kind of untrusted output
PLANTED = [CALL.format("add", '{"a": 2, "b": 3}'),
           CALL.format("os.system", '{"command": "echo pwned"}'),  # a name the user did not offer
           '<tool_call>\n{"name": "add", "arguments": {"a": 2,, }\n</tool_call><|im_end|>',  # malformed JSON
           CALL.format("add", '{"a": 2, "c": 3}'),  # wrong arguments
           CALL.format("fail", '{"x": "it"}'),  # raises
           CALL.format("weird", '{"n": 1}'),  # unprintable
           CALL.format("slow", '{"seconds": 60}'),  # runs past tool_timeout
           "No call.<|im_end|>"]
ERRORS = ["Tool os.system not found.", "not valid JSON", "wrong arguments for add", "cannot handle it",
          "cannot be printed", "ran past 0.3 s and was stopped"]


@pytest.fixture()
def cli_inputs(qwen_tools, tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS_FILE)
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} plus {i + 1}?"}],
                                "answer": 2 * i + 1}) + "\n")
    base = [RECIPE, f"model={qwen_tools}", f"data={tmp_path / 'train.jsonl'}", "max_steps=1", "batch_size=4",
            "grad_accum=1", "num_generations=2", f"max_completion_length={MAX_COMPLETION}", "max_len=2048", "lora_r=4",
            "checkpointing=false", "log_completions_every=1"]
    return tmp_path, base


def test_planted_untrusted_calls_from_the_command_line(cli_inputs, monkeypatch):
    """`python -m minitrain recipes/grpo_qwen.py tools=file.py:add,fail,weird,slow` with the model's first
    turns planted: every bad call is answered by an error tool message the model then reads (the
    context of its next turn), the rollout goes on, the step trains, and the failures are counted."""
    from minitrain.cli import run_cli
    from minitrain.text.tokenizer import Tokenizer

    tmp_path, base = cli_inputs
    tok = Tokenizer.from_folder(base[1].split("=", 1)[1])
    eos = tok.special_id("<|im_end|>")
    contexts: list[str] = []

    def fake_sample(model, ids, mask, *, num_generations=1, max_new_tokens, **kw):
        if num_generations == 2:  # a rollout's first turns (the audit's before step 1 has fewer rows)
            contexts.clear()
            texts = PLANTED[: ids.shape[0] * 2]
        else:  # after the tool turns: read what the model was shown
            contexts.extend(tok.decode(row[m.bool()].tolist(), skip_special=False) for row, m in zip(ids, mask))
            texts = ["Done.<|im_end|>"] * (ids.shape[0] * num_generations)
        rows = [tok.encode(t)[:max_new_tokens] for t in texts]
        C = max(len(r) for r in rows)
        return Completions(torch.tensor([r + [tok.pad_id] * (C - len(r)) for r in rows]),
                           torch.tensor([[1] * len(r) + [0] * (C - len(r)) for r in rows]),
                           torch.tensor([r[-1] != eos for r in rows]))

    monkeypatch.setattr(agent_module, "sample", fake_sample)
    out = tmp_path / "run"
    assert run_cli([*base, f"out={out}", f"tools={tmp_path / 'tools.py'}:add,fail,weird,slow",
                    f"rewards={tmp_path / 'reward.py'}:long", "tool_timeout=0.3"]) == 0
    assert len(contexts) == 7  # each of the step's 7 calls got its tool turn and the model went on
    shown = "\n".join(contexts)
    assert "<tool_response>\n5\n</tool_response>" in shown
    for e in ERRORS:
        assert e in shown, e
    assert "<tool_response>\n{'error': 'Tool os.system not found.'}\n</tool_response>" in shown  # and nothing ran
    m = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert m["tools/call_frequency"] == pytest.approx(7 / 8) and m["tools/failure_frequency"] == pytest.approx(6 / 7)
    assert (out / "adapter").is_dir()
    sample = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert sample and "Done." in sample[0]["completion"]


def test_an_environment_from_the_command_line(cli_inputs):
    """environment=file.py:Counter (TRL's contract, no rewards=): reset's text makes each rollout's prompt
    its own, its get_reward is the reward, logged under the class name; the real sampler runs (a random
    model: whatever it writes)."""
    from minitrain.cli import run_cli

    tmp_path, base = cli_inputs
    out = tmp_path / "env"
    base = [a for a in base if not a.startswith("max_completion_length=")]
    assert run_cli([*base, f"out={out}", f"environment={tmp_path / 'tools.py'}:Counter", "max_completion_length=8"]) == 0
    m = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert "rewards/Counter/mean" in m and "tools/call_frequency" in m


@pytest.mark.parametrize("args,message", [
    (["tools={d}/missing.py:add"], "tools: {d}/missing.py: no such file"),
    (["tools={d}/tools.py:sub"], "defines no function 'sub' (functions there: add, fail, weird, slow)"),
    (["tools={d}/tools.py:NOT_A_FUNCTION"], "NOT_A_FUNCTION in {d}/tools.py is not a function"),
    (["tools=add"], "the recipe defines no function 'add'"),
    (["environment={d}/tools.py:add"], "add is a function, not a class"),
    (["environment={d}/tools.py:Nope"], "defines no class 'Nope' (classes there: Counter, NoReward, NoReset)"),
    (["environment={d}/tools.py:NoReset"], "NoReset has no reset method"),
    (["environment={d}/tools.py:NoReward"], "NoReward has no get_reward method and rewards= is not set"),
    (["tools={d}/tools.py:add", "chat_format=llama3"], "tools: chat_format=llama3 renders no tools"),
])
def test_user_mistakes_are_one_line_exit_2(cli_inputs, capsys, args, message):
    from minitrain.cli import run_cli

    tmp_path, base = cli_inputs
    out = tmp_path / "bad"
    code = run_cli([*base, f"out={out}", *[a.format(d=tmp_path) for a in args]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and message.format(d=tmp_path) in err[-1], err
    assert not out.exists()


def test_the_tool_demo_learns_to_call_the_calculator_and_the_hidden_control_stays_low(tmp_path):
    """demo/grpo_tools (tools/make_grpo_tools_demo.py): the tiny model estimates products in its head
    (greedy, held-out accuracy 0) and calls `mul` in about one sample in seven. GRPO with the tool: held-out
    accuracy <= 0.2 before step 1, >= 0.8 after 30 steps (measured 0.00 -> 1.00, ~7 CPU-seconds); the
    same run with the tool's results hidden (`calc_hidden.py:mul` answers `?`) stays <= 0.2 (measured 0.00)."""
    from minitrain.cli import run_cli

    demo = Path(RECIPE).parent.parent / "demo" / "grpo_tools"
    keys = [f"config={demo / 'run.json'}", f"model={demo / 'model'}", f"data={demo / 'train.jsonl'}",
            f"eval_data={demo / 'eval.jsonl'}", f"rewards={demo / 'calc.py'}:correct"]
    evals = {}
    for name, tool in (("tool", "calc.py"), ("hidden", "calc_hidden.py")):
        out = tmp_path / name
        assert run_cli([RECIPE, *keys, f"tools={demo / tool}:mul", f"out={out}"]) == 0
        evals[name] = {r["step"]: r["eval/reward"] for r in map(json.loads, (out / "eval.jsonl").read_text().splitlines())}
    assert evals["tool"][0] <= 0.2 and evals["tool"][30] >= 0.8, evals
    assert max(evals["hidden"].values()) <= 0.2, evals


FAMILIES = [("qwen", "qwen2_5", "hermes", {}), ("qwen", "qwen3", "hermes", {}),
            ("llama3", "llama3_1", "llama3", {"date_string": "26 Jul 2024"}),
            ("llama3", "llama3_2", "llama3", {"date_string": "24 Nov 2026"}),
            ("gptoss", "gptoss", "harmony", {})]


@pytest.mark.parametrize("family, template, fmt, kwargs", FAMILIES, ids=[f[1] for f in FAMILIES])
def test_each_familys_template_offers_tools_and_renders_tool_turns_as_trl(tmp_path, family, template, fmt, kwargs):
    """With each family's own chat template: the call format is recognised, a prompt with tools is
    transformers' `apply_chat_template(tools=...)`, and a tool turn's ids are TRL's `_get_tool_suffix_ids`
    (its code, run on the transformers tokenizer; for Qwen3, whose template is not prefix-preserving, TRL
    renders with its training template `qwen3_training.jinja`, and so does the reference here).
    (Mistral v0.3's template demands 9-character tool_call_ids that TRL's tool turns do not carry: its
    calls parse, but its template cannot render TRL's tool turns, on either side.)"""
    import types as pytypes

    import transformers
    import trl

    from minitrain.text.tokenizer import Tokenizer
    from test_chat_template import TEMPLATES, _family_folder

    d = _family_folder(tmp_path / "tok", family)
    shutil.copy(TEMPLATES / f"{template}.jinja", d / "chat_template.jinja")
    tok = Tokenizer.from_folder(d)
    tok.chat_template_kwargs = dict(kwargs)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    kit = ToolKit(tok, [("add", add)], max_rounds=1, timeout=1.0, max_completion_length=64)
    assert kit.format == fmt
    stops = {"gptoss": ["<|call|>"]}.get(family, [])  # (the tiny llama3 vocabulary here has no <|eom_id|>)
    assert kit.stop_ids() == [tok.special_id(t) for t in stops]
    msgs = [{"role": "user", "content": "What is 2 plus 3?"}]
    assert tok.encode_chat(msgs, add_generation_prompt=True, tools=kit.schemas)[0] == hf.apply_chat_template(
        msgs, tools=[add], add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
    training = Path(trl.__file__).parent / "chat_templates" / f"{template}_training.jinja"
    trl_self = pytypes.SimpleNamespace(processing_class=hf, _tokenizer=hf, _is_vlm=False, chat_template_kwargs=kwargs,
                                       chat_template=training.read_text() if template == "qwen3" else None)
    for messages in ([{"role": "tool", "name": "add", "content": "5"}],
                     [{"role": "tool", "name": "add", "content": "5"},
                      {"role": "tool", "name": "add", "content": "{'error': 'Tool nope not found.'}"}]):
        assert kit.suffix_ids(messages) == trl.GRPOTrainer._get_tool_suffix_ids(trl_self, messages), messages
