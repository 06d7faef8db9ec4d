"""``python -m popjax.cli ...``: the ``popjax`` command (how ``popjax plan`` re-runs itself)."""

import sys

from . import main

sys.exit(main())
