"""Rewrite rules: one per file, each a pattern, its sub-operator and its finish, registered
with a priority (tried from the highest).

    >>> from rewrite_rules import RULES
    >>> [r.name for r in RULES]
    ['embed_concat_dense', 'fm_interaction', 'bi_interaction', 'lr_sum', 'field_rows']

A rule's ``match(graph, fields, node)`` returns None (the pattern does not fire at this
node), a ``Match`` or a ``Rejection`` (it fires but substituting would not be safe, with the reason).
"""
from rewrite_rules.base import RULES, Match, Rejection, Rule, check_vectors, register
from rewrite_rules import bi_interaction, embed_concat_dense, field_rows, fm_interaction, lr_sum  # noqa: F401  (registers)
from rewrite_rules.search import find_substitutions, rule_named  # noqa: E402

__all__ = ["Match", "Rejection", "Rule", "register", "RULES", "check_vectors", "find_substitutions", "rule_named"]
