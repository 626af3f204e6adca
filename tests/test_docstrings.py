"""The ``>>>`` examples in the docstrings of des, des_ops, models and rewrite_rules run as tests,
so they cannot go stale. An example that needs a launcher, several processes, real data files or
root is marked ``# doctest: +SKIP`` in its docstring; everything else runs, and
test_examples_ran fails if the number of examples that ran drops (so a docstring cannot pass by
skipping everything)."""
import doctest
import functools
import importlib
import pkgutil

import pytest
import tensorflow as tf

import des
import des_ops
import models
import rewrite_rules

PACKAGES = (des, des_ops, models, rewrite_rules)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# Modules whose examples fail and whose file may not be edited now (another engineer's work):
# remove a name from this set once its docstring is fixed.
EXCLUDED: set[str] = set()     # modules whose examples cannot run yet (none)

MIN_RAN = 240     # examples that ran (not skipped); raise it when you add examples


def _module_names() -> list[str]:
    names = []
    for pkg in PACKAGES:
        names.append(pkg.__name__)
        names += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
    return sorted(names)


MODULES = _module_names()


@functools.lru_cache(maxsize=None)
def _run(name: str) -> tuple[int, int, int, str]:
    """(failed, attempted, skipped, report) of the examples in module ``name``'s docstrings.

    Each docstring starts from a fresh Keras session and table-name counter (models.layers.table_name:
    names as in a new interpreter), and the registries an example may add to (rules, adapters) and
    the counter are put back afterwards."""
    from des.graph import adapters
    from models import layers as model_layers
    from rewrite_rules import base
    module = importlib.import_module(name)
    out: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    skipped = 0
    for test in doctest.DocTestFinder().find(module, name):
        if not test.examples:
            continue
        skipped += sum(1 for ex in test.examples if ex.options.get(doctest.SKIP))
        rules, adapter_map = list(base.RULES), dict(adapters.ADAPTERS)
        tables = dict(model_layers._names_used)     # table names as the first model in a process gets
        model_layers._names_used.clear()
        tf.keras.backend.clear_session()
        try:
            runner.run(test, out=out.append)
        finally:
            base.RULES[:] = rules
            adapters.ADAPTERS.clear()
            adapters.ADAPTERS.update(adapter_map)
            model_layers._names_used.clear()
            model_layers._names_used.update(tables)
    return runner.failures, runner.tries, skipped, "".join(out)


@pytest.mark.parametrize("name", [n for n in MODULES if n not in EXCLUDED])
def test_docstring_examples(name):
    failed, attempted, skipped, report = _run(name)
    assert failed == 0, f"{failed} of {attempted} examples in {name} failed:\n{report}"


def test_examples_ran():
    counts = {n: _run(n) for n in MODULES if n not in EXCLUDED}
    ran = sum(c[1] for c in counts.values())
    skipped = sum(c[2] for c in counts.values())
    print(f"docstring examples: {ran} ran, {skipped} skipped, in {len(counts)} modules")
    assert ran >= MIN_RAN, f"only {ran} docstring examples ran ({skipped} skipped)"


def test_every_module_is_found():
    assert {"models.spec", "des.train", "des.baselines.allocate", "des_ops.comm", "models.zoo",
            "rewrite_rules.base"} <= set(MODULES)
