"""A recipe with a syntax error on line 6 (tests/bad_inputs)."""
from minitrain.config import TrainConfig

config = TrainConfig(
    lr=1e-4,
    max_steps=10
    batch_size=2,
)


def run(config):
    pass
