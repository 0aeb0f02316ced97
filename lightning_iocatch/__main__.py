"""``python -m lightning_iocatch``: the same as the ``lightning-iocatch`` command."""

import sys

from lightning_iocatch.cli import main

sys.exit(main())
