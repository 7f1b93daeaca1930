"""The name pipegen is installed by: `pipegen` on PyPI is another project, so the distribution is `pipegen-rl`
(pyproject.toml's `[project] name`), while the import name and the command stay `pipegen`.

Owns: that name, for every message that tells a user what to pip install, and for reading the installed version.
Must never: import anything (every floor may import it).
"""

DISTRIBUTION = "pipegen-rl"


def pip_install(extra: str) -> str:
    """The command that installs pipegen with one of its extras (pyproject.toml's optional-dependencies): from a
    checkout, since no package index serves pipegen yet."""
    return f"pip install '.[{extra}]' in pipegen's checkout"
