"""The simulated fleet: vLLM/SGLang-like workers with a paged prefix cache that speak the real
formats (/metrics, KV events over ZMQ, OpenAI API), plus routers, workloads and fault scenarios."""
