"""``python -m engine.train``: the same as ``python -m engine.train.target``."""
import sys

from .target import main

sys.exit(main())
