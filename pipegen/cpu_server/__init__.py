"""pipegen's embedded CPU reference server: SGLang 0.5.12's native ``/generate`` protocol served on CPU.

Started by module name, the way SGLang is: ``python -m pipegen.cpu_server --model-path DIR [flags]``. The
core - launcher, actor, writer, status - talks to it over HTTP only and never imports this package, so the
same run can point at real SGLang servers instead.

Modules: ``cli`` (flags, the model backend's choice), ``lifecycle`` (the process life: the port bound before
the model loads, then serving until a signal), ``server`` (the aiohttp app and its routes), ``errors`` /
``sampling_params`` / ``parse`` / ``responses`` (the wire protocol as pure functions), ``model_backend`` (the
backend contract and model facts), ``hf_backend`` + ``hf_sampling`` (transformers on CPU, batched),
``vision`` (``image_data`` through a vision model's own path). Other model backends plug in with ``--engine package.module:ClassName`` (the flag keeps
``llm.engine``'s name). The word "engine" elsewhere in pipegen means a server pipegen speaks to
(pipegen/engines/).
Must never: import torch or transformers at package import time (the server binds its port before the model
loads), or import test code.
"""
