"""The compiler: des.transform's rewrite of a Keras model into this process's DES model.

api (the entry point) -> functional (a functional graph) / subclassed (a traced ``call``, towers)
-> report (what was substituted and why not); plan (which process owns which field), cost
(the auto choices), fusion (tables of one width in one), keys (rank-independent state keys, the
rank-0 sync), handle (des.distributed), options (des.Options). It reads models through des.graph
and the rules in rewrite_rules, and imports nothing of des.runtime or des.jobs.
"""
from des.compiler.api import transform
from des.compiler.options import Options
from des.compiler.report import Report, TransformError
from des.compiler.subclassed import trace_call
from rewrite_rules import find_substitutions
from des.graph.fields import FieldVector

__all__ = ["transform", "Options", "Report", "TransformError", "trace_call", "find_substitutions", "FieldVector"]
