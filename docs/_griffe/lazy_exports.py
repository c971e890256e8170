"""A griffe extension for the API reference: the names a package exports lazily become aliases griffe can resolve.

``jagg_lightning`` and ``jagg_lightning.rewards`` import their public names on first use (PEP 562 ``__getattr__``
over a ``_PUBLIC`` dict: name -> the module defining it), so ``jagg --help`` imports no torch. Griffe reads source
and sees no import of ``JAGGModule`` in ``jagg_lightning/__init__.py``; this extension reads each package's
``_PUBLIC`` (a dict literal) and adds one alias per name, so ``::: jagg_lightning.JAGGModule`` resolves to wherever
``_PUBLIC`` says the class lives (a module moved inside the package needs no change to the reference pages).
A value with a dot is a full module path (``"jagg_lightning.module"``), one without is a submodule of the package
(``"base"`` in ``jagg_lightning.rewards``).

The docstrings also use a few reST roles (``:class:`Reward```, ``:mod:`~jagg_lightning.rewards.base```) that
Markdown would print raw: :class:`ReSTRoles` renders each as the code span of its target (``~`` keeps the last part,
as Sphinx does).
"""

from __future__ import annotations

import ast
import re
from typing import Any

import griffe


class LazyExports(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._add_aliases(pkg)

    def _add_aliases(self, module: griffe.Module) -> None:
        public = module.members.get("_PUBLIC")
        if public is not None and not public.is_alias and public.is_attribute and public.value is not None:
            for name, where in ast.literal_eval(str(public.value)).items():
                if name in module.members:
                    continue
                source = where if "." in where else f"{module.path}.{where}"
                module.set_member(name, griffe.Alias(name, f"{source}.{name}", parent=module))
        for member in list(module.members.values()):
            if not member.is_alias and member.is_module:
                self._add_aliases(member)


ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|obj|exc):`(~?)([^`]+)`")


def _code_span(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class ReSTRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code_span, obj.docstring.value)
