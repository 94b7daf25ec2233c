"""A recipe that forgets `config` (tests/bad_inputs)."""


def run(config):
    pass
