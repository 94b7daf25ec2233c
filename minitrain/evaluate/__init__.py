"""Evaluate: held-out evaluation that generates, scored.

Modules, in reading order:
    generation  decode the eval set with the model, score it (ROUGE) at each evaluation, stop
                early on an eval metric (seq2seq runs)
    rouge       ROUGE-N and ROUGE-L, exactly as Google's rouge-score scores them
    harness     our models in lm-evaluation-harness: loglikelihood, rolling, generate_until as its
                `hf` backend computes them (minitrain evaluate registers it as `minitrain`)

The held-out loss is the loop's own (`minitrain.train.evaluate`, or an objective's `evaluate`).
"""
