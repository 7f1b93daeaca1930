"""pipegen's shipped config folder (the primary pipegen.yaml, the example agent loops and tool configs), installed
as the package `pipegen.conf` (pyproject.toml's package-dir). pipegen/config/compose.py locates it by that name
(an editable install maps the name to this folder, a wheel holds it at pipegen/conf/); nothing imports it."""
