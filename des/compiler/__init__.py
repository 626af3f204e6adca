"""The compiler: des.transform's rewrite of a Keras model into this process's DES model.

api (the entry point) -> functional (a functional graph) / subclassed (a traced ``call``, towers)
-> report (what was substituted and why not); plan (which process owns which field), cost
(the auto choices), fusion (tables of one width in one), keys (rank-independent state keys, the
rank-0 sync), handle (des.distributed), options (des.Options). It reads models through des.graph
and the rules in rewrite_rules, and imports nothing of des.runtime or des.jobs. Its names load on
first use, so that des.compiler.options (read by des.train's option parsing) loads no TensorFlow.
"""
import importlib

_HOMES = {"transform": "des.compiler.api", "Options": "des.compiler.options", "Report": "des.compiler.report",
          "TransformError": "des.compiler.report", "trace_call": "des.compiler.subclassed",
          "find_substitutions": "rewrite_rules", "FieldVector": "des.graph.fields"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'des.compiler' has no attribute {name!r}")
