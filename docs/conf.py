"""Sphinx configuration: ``./run docs`` builds the site into ``docs/_build/html``.

Markdown pages (MyST), the API reference from the numpydoc docstrings (autodoc +
autosummary + numpydoc), the PyData theme. The build runs with ``-W`` (warnings are errors)
and needs no network: no intersphinx inventories are fetched.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

from sphinx.util.inspect import stringify_signature

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Importing the package must not start anything heavy: JAX is started only at a step's first
# draw, and autodoc only imports.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pymc_sgmcmc  # noqa: E402

project = "pymc-sgmcmc"
author = "pymc-sgmcmc developers"
copyright = "2026, pymc-sgmcmc developers"  # noqa: A001
version = release = pymc_sgmcmc.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# figures/*.md are tables included by the pages, not pages of their own.
exclude_patterns = ["_build", "figures/*.py", "figures/*.md", "Thumbs.db", ".DS_Store"]

# MyST: $...$ math and ```{math} blocks in the pages; ## headings get anchors for links.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc / autosummary
autosummary_generate = True
autosummary_ignore_module_all = False  # a module page lists what its __all__ exports
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "none"  # the signatures carry the types; numpydoc renders the prose
autodoc_preserve_defaults = True

# Classes: the constructor's signature on the class line, then the documented members the
# class itself defines (_templates/autosummary/class.rst: no tables of undocumented ones).
templates_path = ["_templates"]


def _constructor_signature(app, what, name, obj, options, signature, return_annotation):
    """Show ``__init__``'s signature where a ``__new__(cls, *args, **kwargs)`` hides it.

    PyMC's ``BlockedStep.__new__`` takes ``*args, **kwargs``, and autodoc prefers ``__new__``
    to ``__init__``: every step method would read ``SGLD(*args, **kwargs)``.
    """
    if what != "class" or signature != "(*args, **kwargs)" or "__init__" not in dir(obj):
        return None
    init = inspect.signature(obj.__init__)
    parameters = list(init.parameters.values())[1:]  # drop self
    init = init.replace(parameters=parameters, return_annotation=inspect.Signature.empty)
    return stringify_signature(init, show_annotation=False), return_annotation


def setup(app):
    app.connect("autodoc-process-signature", _constructor_signature)


# numpydoc: class members are listed by autodoc itself (avoids stub-less autosummary tables)
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
numpydoc_validation_checks: set[str] = set()

html_theme = "pydata_sphinx_theme"
html_title = "pymc-sgmcmc"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_static_path: list[str] = []
