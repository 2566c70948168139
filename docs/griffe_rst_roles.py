"""A griffe extension for the API pages (mkdocs.yml loads it): the docstrings are plain prose with rST-style
cross-references (:class:`ConfigError`, :func:`~acceltrain.hooks.builtin_hooks`), which Markdown would show
as ":class:" followed by the name. Each becomes inline code of the name (the last part for a ``~`` name)."""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|exc|obj):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    tilde, name = match.groups()
    return f"`{name.rsplit('.', 1)[-1] if tilde else name}`"


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
