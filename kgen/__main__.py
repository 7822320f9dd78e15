"""`python -m kgen`: the `kgen` command."""

import sys

from kgen.cli import main

sys.exit(main())
