"""The demo's control: the calculator's result is hidden from the model (tools/make_grpo_tools_demo.py)."""


def mul(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return "?"
