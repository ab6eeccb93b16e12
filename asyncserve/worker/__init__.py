"""A device worker: the model runner and what runs on its device (KV pool, input batch, CUDA
graphs, sampler, logprobs, grammar masks)."""
