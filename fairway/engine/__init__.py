"""The engine model: a vLLM-like continuous-batching engine (``model.py``) over a paged KV block
pool with prefix caching and LRU eviction (``block_pool.py``), timed by ``fairway.cost_model``.
The simulator drives it on a virtual clock; the replicas' sim engine drives it in real time."""
