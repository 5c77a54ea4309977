"""``python -m megatron_ext``: the ``megatron-ext`` command line."""

import sys

from .cli import main

sys.exit(main())
