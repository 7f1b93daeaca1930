"""pipegen's own LLM servers: the CPU reference server that speaks SGLang 0.5.12's native protocol.

Owns: ``protocol`` (request validation and response building, no I/O), ``reference_server`` (the aiohttp
process), ``hf_engine`` (transformers on CPU, batched). The deterministic fake engine lives in
``pipegen.testing.fake_engine``.
Must never: import torch or transformers at package import time (the fake engine and the launcher stay light).
"""
