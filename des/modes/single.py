"""``--mode single``: one process, the untouched reference model (des.modes.base's defaults).

    python -m des.train --model deepfm --data train.txt
"""
from __future__ import annotations

from des.modes.base import Mode


class Single(Mode):
    name = "single"
