"""``--mode single``: one process, the untouched reference model (des.jobs.modes.base's defaults).

    python -m des.train --model deepfm --data train.txt
"""
from __future__ import annotations

from des.jobs.modes.base import Mode


class Single(Mode):
    name = "single"
