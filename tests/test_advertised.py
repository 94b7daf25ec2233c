"""Every command the README, docs/ and the recipes advertise for a GPU budget fits it (issue 14, item 3).

A command is advertised for a checkpoint when it passes `model=/path/to/<checkpoint>`; it must
state its budget ("12 GB", in a `#` comment on the command or in the text just before it), and
`minitrain plan` (the project's own planner, reading only `config.json`) must say it fits, planned
on the real `config.json` of the checkpoint it names (tests/fixtures/configs/). Recipe files
advertise in their docstring and in a `REAL_CHECKPOINT` constant (what the demo prints).
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
COMMAND = re.compile(r"python -m minitrain (recipes/\w+\.py)([^\n`\"#]*)(#[^\n]*)?")
BUDGET = re.compile(r"(\d+) GB")


def _plan_tool():
    module = importlib.import_module("minitrain.commands.plan")
    return module


def _texts() -> list[tuple[str, str]]:
    """(where, text) of every place that advertises commands: Markdown files, recipe docstrings
    and REAL_CHECKPOINT constants (with the comment above them as their context)."""
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    for p in sorted((ROOT / "recipes").glob("*.py")):
        source = p.read_text()
        tree = ast.parse(source)
        out.append((f"{p.relative_to(ROOT)} docstring", ast.get_docstring(tree) or ""))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "REAL_CHECKPOINT" for t in node.targets):
                above = source.splitlines()[node.lineno - 2]  # the comment line that states the budget
                out.append((f"{p.relative_to(ROOT)} REAL_CHECKPOINT", above + "\n" + ast.literal_eval(node.value)))
    return out


def advertised() -> list[tuple[str, str, list[str], str]]:
    """(where, recipe, key=value args, the text the budget is read from) for every advertised command."""
    found = []
    for where, text in _texts():
        joined = re.sub(r"\\\\?\n\s*", " ", text)  # `\` line continuations (`\\` inside a docstring)
        for m in COMMAND.finditer(joined):
            if "model=/path/to/" not in m.group(2):
                continue
            args = shlex.split(m.group(2))
            if any(a.startswith("model=/path/to/") for a in args):
                context = joined[max(0, m.start() - 400):m.start()] + (m.group(3) or "")
                found.append((where, m.group(1), args, context))
    return found


COMMANDS = advertised()


def test_the_advertised_commands_are_found():
    where = {w.split()[0] for w, *_ in COMMANDS}
    assert {"README.md", "recipes/dpo_mistral.py", "recipes/sft_mistral.py", "recipes/sft_llama.py",
            "recipes/lora_t5.py"} <= where
    names = {a.split("/")[-1] for _, _, args, _ in COMMANDS for a in args if a.startswith("model=")}
    assert names == {"Mistral-7B-Instruct-v0.2", "Meta-Llama-3-8B-Instruct", "flan-t5-base", "Qwen3-0.6B"}
    assert "recipes/grpo_qwen.py" in {r for _, r, _, _ in COMMANDS}


@pytest.mark.parametrize("where,recipe,args,context", COMMANDS, ids=[f"{w}: {' '.join(a)[:60]}" for w, _, a, _ in COMMANDS])
def test_each_advertised_command_fits_its_stated_budget_by_tools_plan(where, recipe, args, context):
    budgets = BUDGET.findall(context)
    assert budgets, f"{where}: `{recipe} {' '.join(args)}` states no GPU budget (e.g. `# 12 GB GPU`)"
    budget = f"{budgets[-1]}GiB"  # a "12 GB" card has 12 GiB
    model = next(a for a in args if a.startswith("model=")).removeprefix("model=/path/to/")
    assert (CONFIGS / model / "config.json").is_file(), f"{where}: no config.json fixture for {model}"
    overrides = [f"model={CONFIGS / model}" if a.startswith("model=") else a for a in args]
    tool = _plan_tool()
    cfg = tool.load_config(str(ROOT / recipe), overrides)
    text, fits = tool.render(cfg, recipe, overrides, {"--gpu-mem": budget, "--device": "cuda", "--all": False})
    assert fits, f"{where}: `{recipe} {' '.join(args)}` does not fit {budget}:\n{text}"


def test_the_old_demo_command_would_not_fit():
    """The check has teeth: the 7B command the demo used to print (no checkpointing) needs ~30 GiB."""
    tool = _plan_tool()
    overrides = [f"model={CONFIGS / 'Mistral-7B-Instruct-v0.2'}", "data=p.jsonl", "quantize=nf4", "checkpointing=false"]
    cfg = tool.load_config(str(ROOT / "recipes" / "dpo_mistral.py"), overrides)
    text, fits = tool.render(cfg, "recipes/dpo_mistral.py", overrides, {"--gpu-mem": "12GiB", "--device": "cuda",
                                                                          "--all": False})
    assert not fits and "checkpointing=true" in text


def test_the_readme_gives_each_first_command_its_time_and_a_way_without_the_pytorch_index():
    """The two commands at the top of the README: how long each part takes, idle and on a busy
    machine, and what to do where download.pytorch.org is out of reach."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    top = text[:text.index("## ")]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:4]]
            for r in top.splitlines() if r.startswith("| ") and not r.startswith("| command")}
    for what in ("install", "the demo", "the tests"):
        (row,) = [cells for name, cells in rows.items() if name.startswith(what)]
        assert all(re.search(r"\d+ (s|min)", cell) for cell in row), (what, row)
    assert "download.pytorch.org cannot be\nreached" in top and "pip install /path/to/torch-2.13.0-" in top
