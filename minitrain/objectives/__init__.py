"""Objectives: `(model, batch) -> (loss sum, count, metrics)`.

An objective sums its loss over its units (target tokens, pairs, rows) and says how many there
were; the loop divides by the whole window's count (rule 2) and knows nothing else about it.

Modules, in reading order:
    configs     each method's run config (KTO, DPO, preference, reward model, GRPO, distillation); imports no torch
    losses      token losses from hidden states in chunks: `B x T x V` logits never exist
    sft         SFT and seq2seq cross-entropy, and the causal log-prob helpers the others share
    reference   a preference pair's two answers scored in one forward, and the reference they are
                scored against without a second model (adapters off, a snapshot, a cache)
    dpo         DPO: sigmoid, IPO, hinge, robust; its held-out pass
    preference  reference-free pair losses: ORPO, CPO, SimPO
    kto         KTO on unpaired, labelled rows
    reward_model  a scalar head on a decoder's last non-pad token: Bradley-Terry on pairs, GRPO's model:DIR
    distill     knowledge distillation: KD + CE, feature matching, attention transfer
    ard         ARD-LoRA's ELBO, its held-out uncertainty evaluation, its prior's schedule
    sampling    G completions per prompt in one batch through the model's KV cache (GRPO's rollout)
    rewards     reward functions (TRL's signature) from a file or a recipe, scored with one-line errors
    tools       tools in the rollout: schemas, each family's call format, calls run as untrusted input
    environments  TRL's environment_factory: a class's instances per rollout, reset, methods as tools, reward
    agent       the rollout with tools / an environment: prompts, sampling, tool rounds, the tool mask
    grpo        GRPO: group advantages, TRL's clipped loss and its variants, the rollout objective
    rloo        RLOO: leave-one-out advantages (KL in the reward), the sequence-level clipped loss
"""
