"""`python -m proxy` is `memproxy`."""

import sys

from proxy.cli.main import main

sys.exit(main())
