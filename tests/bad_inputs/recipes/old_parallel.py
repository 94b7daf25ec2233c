"""A recipe written before the parallel wing (minitrain.distributed, minitrain.fsdp): its imports fail."""

from minitrain.config import SFTConfig
from minitrain.distributed import main_only

config = SFTConfig()


def run(config):
    raise AssertionError("never reached: the import above fails")
