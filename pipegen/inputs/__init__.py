"""A run's inputs, shared by every role: the prompt dataset and its tokenizer (`dataset.py`), the embedded
default model (`models.py`), a vision model's processor and the launch's refusals for images, videos and audio
(`media.py`), and the packaged demo prompts (`demo.py`, `demo_arith.parquet`, made once by `make_demo.py`).

Must never: import a role (launch, actor, writer, export) or write into a run directory.
"""
