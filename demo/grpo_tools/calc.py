"""The demo's calculator tool and its reward (tools/make_grpo_tools_demo.py)."""


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def correct(prompts, completions, answer, **_) -> list[float]:
    """1 when the model's last message is exactly the row's `answer`, else 0."""
    return [1.0 if c[-1]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]
