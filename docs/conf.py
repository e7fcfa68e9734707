"""Sphinx configuration: the user guide and how-it-works pages (Markdown) and the API reference
(autodoc of the docstrings). Build with warnings as errors, as CI does:

    python -m sphinx -W --keep-going docs docs/_build
"""
project = "torch_grnnd"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
napoleon_google_docstring = True
napoleon_use_ivar = True  # dataclass "Attributes:" as fields, not as second descriptions of the members
autodoc_member_order = "bysource"
myst_heading_anchors = 3
html_theme = "alabaster"
