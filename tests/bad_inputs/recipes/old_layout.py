"""A recipe written against minitrain's flat layout (before the subpackages): its imports fail."""

from minitrain.config import SFTConfig
from minitrain.lora import apply_lora, save_adapter

config = SFTConfig()


def run(config):
    raise AssertionError("never reached: the import above fails")
