"""Rewrite rules: one per file, each a pattern plus what the DES sub-operator needs.

    >>> from rewrite_rules import RULES
    >>> [r.name for r in RULES]
    ['fm_interaction', 'embed_concat_dense', 'lr_sum']

A rule's ``match(graph, node)`` returns None (the pattern does not fire at this node), a
``Match`` or a ``Rejection`` (it fires but substituting would not be safe, with the reason).
"""
from rewrite_rules.base import Match, Rejection, Rule, register, RULES
from rewrite_rules import fm_interaction, embed_concat_dense, lr_sum  # noqa: F401  (registers)

__all__ = ["Match", "Rejection", "Rule", "register", "RULES"]
