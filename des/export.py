"""``des.export(model, out)``, ``des.export(checkpoint_folder, out)`` and ``python -m des.export``:
see des.runtime.export. This module is callable."""
import sys

from des.runtime.export import export, export_model, main  # noqa: F401 - the public names

sys.modules[__name__].__class__ = type(sys.modules["des.runtime.export"])

if __name__ == "__main__":
    sys.exit(main())
