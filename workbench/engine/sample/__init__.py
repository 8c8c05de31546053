"""Sampling: per-request SamplingParams, penalties and logit bias, grammar masks, the batched Sampler
and logprobs."""
