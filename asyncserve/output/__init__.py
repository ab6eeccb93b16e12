"""Output: sampled tokens to RequestOutputs (detokenizing, stop strings, logprobs) and the
per-request streams the callers read."""
