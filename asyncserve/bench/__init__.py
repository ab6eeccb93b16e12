"""`python -m asyncserve bench throughput|latency|serve`: the figures vLLM's bench reports."""
