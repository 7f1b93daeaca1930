"""A run's inputs, shared by every role: the prompt dataset and its tokenizer (`dataset.py`), the embedded
default model (`models.py`) and the packaged demo prompts (`demo.py`, `demo_arith.parquet`).

Must never: import a role (launch, actor, writer, export) or write into a run directory.
"""
